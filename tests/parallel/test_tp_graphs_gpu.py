"""CUDA graphs and overlap scheduling with tensor parallelism on 2 GPUs (NCCL): each rank captures its decode step
(all-reduces of the row-parallel layers, the LM head's all-gather, the swap-in and attention kernels inside the
graph) and replays it one pass ahead of the host (tests/parallel/tp_graph_workers.py), TP=2 and EP=2, wide
tiny-dsa in bf16 on the GPU kernels.

Exact, on every rank: (a) a replayed step == the same padded step run eagerly (the runner's uncaptured path), bit
for bit, in both modes: NCCL's collectives captured in a graph sum as they do eagerly; (b) HiSparse == dense with
graphs on; (c) both ranks produce the same tokens and logits. Graphs on against `--disable-cuda-graph` is another
computation (GEMMs of the bucket's rows) and is held to near ties on one GPU (tests/hisparse/test_cuda_graph_gpu.py);
overlap against the synchronous loop is checked bit for bit on CPU ranks (tests/parallel/test_tp_overlap.py).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs (NCCL)", allow_module_level=True)

from tp_graph_workers import graph_rank  # noqa: E402
from tp_workers import run_ranks  # noqa: E402

from decode_server.model import resolve_model_path  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    resolve_model_path("tiny-dsa")  # the tokenizer's files, generated before the ranks race to
    return run_ranks(graph_rank, tmp_path_factory.mktemp("tp_graphs"), timeout_s=600)


def assert_same(what: str, a: dict, b: dict) -> None:
    assert a["tokens"] == b["tokens"], f"{what}: tokens differ"
    for rid, logits in a["logits"].items():
        assert len(logits) == len(b["logits"][rid]), f"{what}: {rid} logits count differs"
        for i, (x, y) in enumerate(zip(logits, b["logits"][rid], strict=True)):
            assert not x.isnan().any(), f"{what}: {rid} token {i}: NaN"
            assert torch.equal(x, y), f"{what}: {rid} token {i}: logits differ by {float((x - y).abs().max()):.3e}"


@pytest.mark.parametrize("scenario", ["tp", "ep"])
def test_graph_replay_equals_padded_eager_and_hisparse_equals_dense(ranks, scenario: str) -> None:
    for rank, results in enumerate(ranks):
        runs = results[scenario]
        for mode in ("dense", "hisparse"):
            graphs, eager = runs[f"{mode}_graphs"], runs[f"{mode}_eager"]
            assert graphs["replays"] >= 15 and graphs["eager"] == 0, (graphs["replays"], graphs["eager"])
            assert eager["eager"] == graphs["replays"] and eager["replays"] == 0
            assert graphs["idle"] and eager["idle"], f"rank {rank} {mode}: a pool or request row was not given back"
            assert_same(f"(a) rank {rank} {scenario} {mode}: replay vs padded eager", graphs, eager)
        assert runs["hisparse_graphs"]["misses"] > 0, "HiSparse never swapped a row in from the host pool"
        assert_same(f"(b) rank {rank} {scenario}: HiSparse vs dense, graphs on", runs["dense_graphs"],
                    runs["hisparse_graphs"])


@pytest.mark.parametrize("scenario", ["tp", "ep"])
def test_ranks_agree_with_graphs(ranks, scenario: str) -> None:
    first, second = (r[scenario] for r in ranks)
    for variant in ("dense_graphs", "hisparse_graphs"):
        assert_same(f"(c) {scenario} {variant}: rank 0 vs rank 1", first[variant], second[variant])
