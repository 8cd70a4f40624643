"""Data-parallel attention on 2 GPUs (NCCL): each rank serves its own requests through the real Engine on its GPU
in bf16 (tests/parallel/dp_workers.py `gpu_dp_scenarios`), experts split across the ranks (EP=2), on tiny-dsa
(16 heads, all on each rank; PyTorch reference kernels on the GPU) and on "wide" tiny-dsa (64 heads, top-k 128,
random weights: the Triton/FlashMLA, indexer and swap-in kernels). Rank 1's work ends before rank 0's, so it runs
idle passes (zero tokens through NCCL's all-gather and reduce-scatter).

Exact: on every rank HiSparse is bit-identical to dense (both ranks' batches are the same in both runs). Against
one GPU running that rank's requests alone the greedy tokens must agree except at a bf16 near tie on tiny-dsa, and
exactly (logits within float32 rounding) for the wide model in float32 on the reference kernels, as in
test_tp_gpu.py (the MLPs' partial sums and the MoE's GEMM shapes differ from one GPU's; the wide model's top-k
selection turns bf16 rounding into logit moves of up to ~3, so its bf16 runs are not compared with one GPU).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs (NCCL)", allow_module_level=True)

from dp_workers import gpu_dp_scenarios, gpu_engine_runs  # noqa: E402
from test_tp_gpu import assert_matches_one_gpu  # noqa: E402
from tp_workers import run_ranks  # noqa: E402

from decode_server.model import resolve_model_path  # noqa: E402

SCENARIOS = {"dp_ep": False, "wide_dp_ep": True, "wide_dp_ep_fp32": True}
COMPARED = ("dp_ep", "wide_dp_ep_fp32")  # with one GPU (the wide model's bf16 run is not: see the module doc)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    resolve_model_path("tiny-dsa")
    return run_ranks(gpu_dp_scenarios, tmp_path_factory.mktemp("dp_gpu"), timeout_s=600)


@pytest.fixture(scope="module")
def single() -> dict:
    return {name: [gpu_engine_runs(None, "cuda:0", rank, wide, float32=name.endswith("fp32")) for rank in range(2)]
            for name, wide in SCENARIOS.items() if name in COMPARED}


def test_ranks_use_nccl(ranks):
    assert [r["backend"] for r in ranks] == ["nccl", "nccl"]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_hisparse_equals_dense_on_every_rank(ranks, scenario):
    for rank, results in enumerate(ranks):
        dense, sparse = results[scenario]["dense"], results[scenario]["hisparse"]
        assert sparse["tokens"] == dense["tokens"], f"rank {rank}: HiSparse tokens differ from dense"
        for rid, logits in dense["logits"].items():
            for i, (a, b) in enumerate(zip(logits, sparse["logits"][rid], strict=True)):
                assert torch.equal(a, b), f"rank {rank}: {rid} token {i}: HiSparse logits differ from dense"
        assert dense["idle"] and sparse["idle"], "an engine did not free every page and slot"
    assert ranks[0][scenario]["hisparse"]["misses"] > 0, "HiSparse never swapped a row in from the host pool"
    assert ranks[1][scenario]["dense"]["idle_passes"] > 0, "rank 1 never ran an idle pass"


@pytest.mark.parametrize("scenario", COMPARED)
def test_greedy_tokens_match_one_gpu(ranks, single, scenario):
    for rank in range(2):
        assert_matches_one_gpu(single[scenario][rank]["dense"], ranks[rank][scenario]["dense"],
                               f"rank {rank} {scenario}", exact_tokens=scenario.endswith("fp32"))
