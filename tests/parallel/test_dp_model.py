"""Data-parallel attention on 2 CPU ranks (gloo): each rank's requests get what one device gives them alone.

Each rank runs different prompts (rank 1 stops early and runs idle passes while rank 0 goes on); the MLPs and the
LM head are sharded over both ranks and run over both ranks' tokens, gathered. Greedy tokens must equal one
device's for the same prompts; logits agree within float32 rounding (the MLPs' partial sums are added across ranks
where one device adds inside one GEMM, and the MoE's per-expert GEMMs see both ranks' tokens: see
test_tp_model.py). Through the real Engine, HiSparse on a DP rank is bit-identical to dense on that rank.
"""

from __future__ import annotations

import pytest
import torch
from dp_workers import (
    IDLE_FROM,
    STEPS,
    dp_scenarios,
    engine_runs_single,
    rank_prompts,
    rank_steps,
)
from tp_workers import batched_greedy, recording_backend, run_ranks

from decode_server.model import load_model, resolve_model_path

LOGIT_RTOL = 2e-5  # as test_tp_model.py


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    for name in ("tiny-dsa", "tiny-glm5"):
        resolve_model_path(name)
    return run_ranks(dp_scenarios, tmp_path_factory.mktemp("dp"))


@pytest.fixture(scope="module")
def single() -> dict:
    out = {}
    for name in ("tiny-dsa", "tiny-glm5"):
        model, config = load_model(name, "cpu", torch.float32)
        out[name] = [batched_greedy(model, recording_backend(config), rank_prompts(r, config.vocab_size),
                                    rank_steps(r)) for r in range(2)]  # fmt: skip
    return out


def test_gather_and_reduce_scatter_rows(ranks):
    for rank, results in enumerate(ranks):
        for counts, runs in results["collectives"].items():
            for gathered, back, mine in runs:
                want = torch.cat([r["collectives"][counts][0][2] for r in ranks])
                assert torch.equal(gathered, want), (rank, counts)
                assert torch.equal(back, mine * 3), (rank, counts)


@pytest.mark.parametrize(("scenario", "model"), [("dp", "tiny-dsa"), ("dp_ep", "tiny-dsa"),
                                                 ("dp_lm_head", "tiny-dsa"), ("glm5_ep", "tiny-glm5")])
def test_each_rank_gets_one_devices_tokens(ranks, single, scenario, model):
    for rank, results in enumerate(ranks):
        got, want = results[scenario], single[model][rank]
        assert torch.equal(got["tokens"], want["tokens"]), f"rank {rank}: {scenario} tokens differ from one device"
        error = float((got["logits"] - want["logits"]).abs().max() / want["logits"].abs().max())
        assert error < LOGIT_RTOL, f"rank {rank}: {scenario} logits differ by {error:.2e} (relative)"
    assert ranks[1][scenario]["idle"] == STEPS - IDLE_FROM and ranks[0][scenario]["idle"] == 0


@pytest.fixture(scope="module")
def single_engine() -> list[dict]:
    return [engine_runs_single(rank) for rank in range(2)]


def test_engine_ranks_match_one_device_and_hisparse_is_bit_identical(ranks, single_engine):
    for rank, results in enumerate(ranks):
        want = single_engine[rank]["dense"]["tokens"]
        assert single_engine[rank]["hisparse"]["tokens"] == want
        dense, sparse = results["engine"]["dense"], results["engine"]["hisparse"]
        assert dense["tokens"] == want, f"rank {rank}: dense DP tokens differ from one device"
        assert sparse["tokens"] == want, f"rank {rank}: HiSparse DP tokens differ from one device"
        for rid, logits in dense["logits"].items():
            for i, (a, b) in enumerate(zip(logits, sparse["logits"][rid], strict=True)):
                assert torch.equal(a, b), f"rank {rank}: {rid} token {i}: HiSparse logits differ from dense"
        assert dense["idle"] and sparse["idle"], "an engine did not free every page and slot"
    assert ranks[0]["engine"]["hisparse"]["misses"] > 0, "HiSparse never swapped a row in from the host pool"
    # Rank 1's one short request is done long before rank 0's: it ran idle passes to keep the MLPs' collectives
    # company, and both ranks ran the same number of passes in all.
    for mode in ("dense", "hisparse"):
        first, second = (r["engine"][mode] for r in ranks)
        assert second["idle_passes"] > 0
        assert first["steps"] + first["idle_passes"] == second["steps"] + second["idle_passes"]


def test_engine_decode_passes_padded_to_one_bucket(ranks, single_engine):
    """The CUDA-graph path of DP attention, run eagerly on CPU: decode passes where every rank decodes (or idles)
    are padded by every rank to the bucket of the largest rank's batch (the MLPs' collectives then have the sizes a
    graph was captured with); a rank without requests runs padding rows only. Tokens still equal one device's, and
    HiSparse == dense bit for bit."""
    for rank, results in enumerate(ranks):
        want = single_engine[rank]["dense"]["tokens"]
        dense, sparse = results["engine_padded"]["dense"], results["engine_padded"]["hisparse"]
        assert dense["tokens"] == want and sparse["tokens"] == want, f"rank {rank}: padded DP tokens differ"
        for rid, logits in dense["logits"].items():
            for i, (a, b) in enumerate(zip(logits, sparse["logits"][rid], strict=True)):
                assert torch.equal(a, b), f"rank {rank}: {rid} token {i}: HiSparse logits differ from dense"
        assert dense["idle"] and sparse["idle"], "an engine did not free every page and slot"
    for mode in ("dense", "hisparse"):
        first, second = (r["engine_padded"][mode] for r in ranks)
        assert first["padded"], "no decode pass was padded"
        # the same bucket in every padded pass, whatever each rank's own batch
        assert [bs for bs, _ in first["padded"]] == [bs for bs, _ in second["padded"]]
        assert any(n0 != n1 for (_, n0), (_, n1) in zip(first["padded"], second["padded"], strict=True))
        assert all(bs >= max(n0, n1) for (bs, n0), (_, n1) in zip(first["padded"], second["padded"], strict=True))
        assert second["padded_idle"] > 0 and first["padded_idle"] == 0  # rank 1 idles on padding rows
        assert first["steps"] + first["idle_passes"] == second["steps"] + second["idle_passes"]


@pytest.mark.parametrize("mode", ["dense", "hisparse"])
def test_engine_overlap_equals_sync_on_every_rank(ranks, mode: str) -> None:
    """Overlap scheduling on DP-attention ranks (each its own share of tests/hisparse/test_overlap.py's retraction
    and abort workload, batch-invariant mode): overlapped == synchronous on each rank (an aborted request: a prefix
    of its synchronous tokens), retractions happened, every pool ends empty, and rank 1 (less work) idled."""
    for rank, results in enumerate(ranks):
        sync, overlapped = results["engine_overlap"][f"{mode}_sync"], results["engine_overlap"][f"{mode}_overlap"]
        assert sync["idle"] and overlapped["idle"], f"rank {rank}: a pool or request row was not given back"
        for rid, want in sync["outcomes"].items():
            got = overlapped["outcomes"][rid]
            if "abort" not in (want["finish"][0], got["finish"][0]):
                assert got == want, f"rank {rank} {mode} {rid}: overlapped differs from synchronous"
            else:
                assert got["tokens"] == want["tokens"][: len(got["tokens"])], f"rank {rank} {mode} {rid}"
    assert ranks[0]["engine_overlap"][f"{mode}_overlap"]["retractions"] > 0, "the budget was meant to retract"
    assert ranks[1]["engine_overlap"][f"{mode}_overlap"]["idle_passes"] > 0, "rank 1 never idled"
