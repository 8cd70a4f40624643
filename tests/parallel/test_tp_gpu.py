"""Tensor and expert parallelism on 2 GPUs (NCCL): tiny-dsa through the real Engine on each rank's GPU, bf16, on
the reference kernels (8 heads per rank) and, as "wide" tiny-dsa (64 heads), on the GPU kernels
(tests/parallel/tp_gpu_workers.py). Each rank's HiSparse pool is the node's one shared host pool, registered with
that rank's GPU; the EP run's engines are the second ones of each rank process, so a pool is registered again
after the first one was released (a registration that outlived its mapping made that fail).

What must hold exactly: on every rank HiSparse is bit-identical to dense (the HiSparse contract holds per rank),
and both ranks produce the same tokens and logits (the replicated indexer and latent projection read all-reduced
hidden states, and NCCL's all-reduce gives every rank the same sum). Against one GPU (TP=1) the greedy tokens
must agree; the logits are not compared bit for bit, because a row-parallel layer sums two bf16 partial
products through the all-reduce where one GPU sums the whole dot product in one GEMM. Where a token differs from
TP=1's, TP=1's own logits at that step must be a near tie: top-1 and the TP=2 token at most BF16_TIE apart.
That bound comes from measured bf16 noise on this random model: on CPU, tiny-dsa's logits in bf16 and in float32
differ by up to 0.42 at steps where the tokens still agree (tests/parallel/tp_gpu_workers.arrivals), and on 2
H200s TP=2 and EP=2 picked another token at one step where TP=1's two logits were 0.5 apart. Sharding itself is
checked tightly by the CPU tests (float32, logits within 2e-5 of one device); here a gross error (a wrong shard
or a lost all-reduce) would show as tokens that differ without a near tie.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs (NCCL)", allow_module_level=True)

from tp_gpu_workers import gpu_engine_runs, gpu_rank_scenarios  # noqa: E402
from tp_workers import run_ranks  # noqa: E402

from decode_server.model import resolve_model_path  # noqa: E402

# Largest TP=1 logit gap that bf16 rounding may close on tiny-dsa (2.4× the bf16-vs-float32 difference measured).
BF16_TIE = 1.0
# Largest |logit| difference between TP=2 / EP=2 / DP=2 and one GPU in float32 on the wide model (measured 0.038 on
# two H200s, 2026-11-28: float32 rounding, through an occasional top-k boundary flip; bf16 moves them by up to 2.9).
FP32_LOGIT_TOL = 0.25


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    resolve_model_path("tiny-dsa")  # generate the checkpoint before the ranks race to
    return run_ranks(gpu_rank_scenarios, tmp_path_factory.mktemp("tp_gpu"), timeout_s=600)


@pytest.fixture(scope="module")
def single() -> dict:
    return {"tp": gpu_engine_runs(None, "cuda:0"), "wide_fp32": gpu_engine_runs(None, "cuda:0", wide=True, float32=True)}


SCENARIOS = ["tp", "ep", "wide_tp", "wide_ep", "wide_tp_fp32", "wide_ep_fp32"]


def test_ranks_use_nccl(ranks):
    assert [r["backend"] for r in ranks] == ["nccl", "nccl"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_hisparse_equals_dense_on_every_rank_and_ranks_agree(ranks, scenario):
    for rank, results in enumerate(ranks):
        dense, sparse = results[scenario]["dense"], results[scenario]["hisparse"]
        assert sparse["tokens"] == dense["tokens"], f"rank {rank}: HiSparse tokens differ from dense"
        for rid, logits in dense["logits"].items():
            for i, (a, b) in enumerate(zip(logits, sparse["logits"][rid], strict=True)):
                assert torch.equal(a, b), f"rank {rank}: {rid} token {i}: HiSparse logits differ from dense"
        assert sparse["misses"] > 0, "HiSparse never swapped a row in from the host pool"
        assert dense["idle"] and sparse["idle"], "an engine did not free every page and slot"
    first, second = (r[scenario] for r in ranks)
    for mode in ("dense", "hisparse"):
        assert first[mode]["tokens"] == second[mode]["tokens"], f"{mode}: ranks generated different tokens"
        for rid, logits in first[mode]["logits"].items():
            assert all(torch.equal(a, b) for a, b in zip(logits, second[mode]["logits"][rid], strict=True)), (
                f"{mode} {rid}: ranks sampled from different logits")


def assert_matches_one_gpu(want: dict, got: dict, label: str, exact_tokens: bool) -> None:
    """Greedy tokens of a parallel run (`got`) against one GPU's (`want`). bf16 (`exact_tokens` False): a token may
    differ only where one GPU's two candidates are within BF16_TIE, and the continuations part there. float32:
    every token equal and every logit within FP32_LOGIT_TOL."""
    for rid, tokens in want["tokens"].items():
        assert len(tokens) == len(got["tokens"][rid])
        if exact_tokens:
            assert got["tokens"][rid] == tokens, f"{label} {rid}: float32 tokens differ from one GPU's"
            gaps = [float((a.float().cpu() - b.float().cpu()).abs().max())
                    for a, b in zip(want["logits"][rid], got["logits"][rid], strict=True)]
            assert max(gaps) <= FP32_LOGIT_TOL, f"{label} {rid}: float32 logits differ from one GPU's by {max(gaps)}"
            continue
        for i, (a, b) in enumerate(zip(tokens, got["tokens"][rid], strict=True)):
            if a != b:
                logits = want["logits"][rid][i].float()
                gap = float(logits[a] - logits[b])
                assert gap <= BF16_TIE, (f"{label} {rid} token {i}: chose {b}, one GPU {a} with a logit gap of "
                                         f"{gap:.3f} (not a bf16 near tie)")
                break  # the continuations differ from here on


@pytest.mark.parametrize("scenario", ["tp", "ep", "wide_tp_fp32", "wide_ep_fp32"])
def test_greedy_tokens_match_one_gpu(ranks, single, scenario):
    """TP=2 / EP=2 against TP=1. The wide model is compared in float32 (reference kernels), not in bf16 on the GPU
    kernels: its top-k selection turns bf16 rounding into different attention inputs — one GPU's own bf16 logits
    differ from its float32 ones by up to 1.6 before any token differs, and TP=2 in bf16 chose a token one GPU's
    float32 run ranks 1.4 below the best (two H200s, 2026-11-28; in float32 every token agreed and the logits
    within 0.038). The bf16 GPU-kernel runs are held to what is exact there: HiSparse == dense, ranks agree."""
    one = single["wide_fp32" if scenario.startswith("wide") else "tp"]
    assert one["hisparse"]["tokens"] == one["dense"]["tokens"]
    assert_matches_one_gpu(one["dense"], ranks[0][scenario]["dense"], scenario, exact_tokens=scenario.endswith("fp32"))
