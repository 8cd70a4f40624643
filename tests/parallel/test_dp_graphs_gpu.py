"""CUDA graphs with data-parallel attention on 2 GPUs (NCCL; tests/parallel/dp_workers.py `gpu_dp_graph_scenarios`):
each rank serves its own requests (wide tiny-dsa in bf16 on the GPU kernels, EP=2); a pass where every rank decodes
(or idles) is padded by every rank to one agreed bucket and replayed, the MLPs' all-gathers and reduce-scatters
inside the graph; rank 1 finishes first and replays the bucket on padding rows only while rank 0 goes on.

Exact, on every rank: (a) the replayed passes == the same padded passes run eagerly, bit for bit, dense and
HiSparse; (b) HiSparse == dense with graphs on; both ranks padded every graph pass to the same bucket.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs (NCCL)", allow_module_level=True)

from dp_workers import gpu_dp_graph_scenarios  # noqa: E402
from test_tp_graphs_gpu import assert_same  # noqa: E402
from tp_workers import run_ranks  # noqa: E402

from decode_server.model import resolve_model_path  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    resolve_model_path("tiny-dsa")
    return run_ranks(gpu_dp_graph_scenarios, tmp_path_factory.mktemp("dp_graphs"), timeout_s=600)


def test_graph_replay_equals_padded_eager_and_hisparse_equals_dense(ranks) -> None:
    for rank, results in enumerate(ranks):
        runs = results["wide_dp_ep"]
        for mode in ("dense", "hisparse"):
            graphs, eager = runs[f"{mode}_graphs"], runs[f"{mode}_eager"]
            assert graphs["replays"] >= 8 and graphs["eager"] == 0, (graphs["replays"], graphs["eager"])
            assert eager["eager"] == graphs["replays"] and eager["replays"] == 0
            assert graphs["padded"] == eager["padded"], f"rank {rank} {mode}: other padded passes"
            assert graphs["idle"] and eager["idle"], f"rank {rank} {mode}: a pool or request row was not given back"
            assert_same(f"(a) rank {rank} {mode}: replay vs padded eager", graphs, eager)
        assert_same(f"(b) rank {rank}: HiSparse vs dense, graphs on", runs["dense_graphs"], runs["hisparse_graphs"])
    assert ranks[0]["wide_dp_ep"]["hisparse_graphs"]["misses"] > 0, "HiSparse never swapped a row in"


def test_ranks_pad_to_one_bucket_and_idle_on_padding(ranks) -> None:
    for mode in ("dense_graphs", "hisparse_graphs"):
        first, second = (r["wide_dp_ep"][mode] for r in ranks)
        assert [bs for bs, _ in first["padded"]] == [bs for bs, _ in second["padded"]], mode
        assert second["padded_idle"] > 0, f"{mode}: rank 1 never replayed a pass of padding rows"
        assert first["steps"] + first["idle_passes"] == second["steps"] + second["idle_passes"]
