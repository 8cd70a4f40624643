"""CUDA graph configuration and the graph runner's static inputs, on CPU: bucket choice, flags, when graphs are
off, and what a padded decode batch puts into the static buffers (the same buffers a graph reads on CUDA)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from decode_server.cli import build_parser, engine_config_from_args
from decode_server.config import EngineConfig
from decode_server.engine.cuda_graph import (
    DecodeGraphRunner,
    bucket_for,
    default_batch_sizes,
    graphs_off_reason,
    resolve_batch_sizes,
)
from decode_server.engine.forward_batch import SCRATCH_SLOTS, ForwardBatch
from kernels import indexer_topk
from kernels.indexer_ref import quantize_index_keys


def test_default_batch_sizes() -> None:
    assert default_batch_sizes(1) == [1]
    assert default_batch_sizes(10) == [1, 2, 4, 8, 10]
    assert default_batch_sizes(64) == [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64]
    sizes = default_batch_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 12, 16] and sizes[-1] == 256 and len(sizes) == 36
    assert default_batch_sizes(237)[-2:] == [232, 237]


def test_resolve_batch_sizes() -> None:
    assert resolve_batch_sizes(None, None, 64) == default_batch_sizes(64)  # capped by the request rows
    assert resolve_batch_sizes(None, None, 1024)[-1] == 256  # SGLang-like default maximum
    assert resolve_batch_sizes(None, 20, 64) == [1, 2, 4, 8, 12, 16, 20]
    assert resolve_batch_sizes([8, 1, 3, 3], None, 64) == [1, 3, 8]
    assert resolve_batch_sizes([1, 2, 64, 128], None, 64) == [1, 2, 64]  # no batch exceeds the request rows
    assert resolve_batch_sizes([1, 2, 32, 48], 32, 64) == [1, 2, 32]
    with pytest.raises(ValueError, match="no size"):
        resolve_batch_sizes([48], 32, 64)


@pytest.mark.parametrize(("batch", "bucket"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (9, 12), (12, 12), (13, None)])
def test_bucket_for(batch: int, bucket: int | None) -> None:
    assert bucket_for(batch, [1, 2, 4, 8, 12]) == bucket


def test_config_flags() -> None:
    args = build_parser().parse_args(["serve", "--cuda-graph-max-bs", "32", "--cuda-graph-bs", "16", "1", "4"])
    cfg = engine_config_from_args(args)
    assert (cfg.disable_cuda_graph, cfg.cuda_graph_max_bs, cfg.cuda_graph_bs) == (False, 32, [1, 4, 16])
    cfg = engine_config_from_args(build_parser().parse_args(["serve", "--disable-cuda-graph"]))
    assert cfg.disable_cuda_graph and cfg.cuda_graph_bs is None and cfg.cuda_graph_max_bs is None
    with pytest.raises(ValidationError):
        EngineConfig(cuda_graph_bs=[0, 2])
    with pytest.raises(ValidationError):
        EngineConfig(cuda_graph_bs=[])
    with pytest.raises(ValidationError):
        EngineConfig(cuda_graph_max_bs=0)


def test_graphs_off_reasons(make_engine) -> None:
    engine = make_engine()
    assert engine.graph_runner is None and engine.cuda_graph_error is None  # CPU: no graphs (not a failure)
    backend = engine.kv.backend
    cuda = torch.device("cuda")
    bf16 = torch.bfloat16
    assert "cpu" in graphs_off_reason(EngineConfig(), torch.device("cpu"), bf16, backend)
    assert graphs_off_reason(EngineConfig(), cuda, bf16, backend) is None
    assert "disable" in graphs_off_reason(EngineConfig(disable_cuda_graph=True), cuda, bf16, backend)
    cfg = EngineConfig(enable_deterministic_inference=True)
    assert "deterministic" in graphs_off_reason(cfg, cuda, bf16, backend)
    assert graphs_off_reason(EngineConfig(tp_size=2, ep_size=2), cuda, bf16, backend) is None  # TP: captured
    cfg = EngineConfig(tp_size=2, dp_size=2, enable_dp_attention=True)
    assert graphs_off_reason(cfg, cuda, bf16, backend) is None  # DP attention: padded to an agreed bucket
    assert "torch_native" in graphs_off_reason(EngineConfig(attention_backend="torch_native"), cuda, bf16, backend)
    assert "dtype" in graphs_off_reason(EngineConfig(), cuda, torch.float32, backend)
    cfg = EngineConfig(disaggregation={"mode": "prefill"})
    assert "prefill" in graphs_off_reason(cfg, cuda, bf16, backend)


@pytest.mark.parametrize("hisparse", [False, True])
def test_static_inputs_of_a_padded_batch(make_engine, hisparse: bool) -> None:
    engine = make_engine(enable_hisparse=hisparse, max_running_requests=8)
    backend = engine.kv.backend
    assert backend.scratch_row == 8
    runner = DecodeGraphRunner(engine.model, backend, engine.device, [4, 8], engine.context_length)
    with pytest.raises(ValueError, match="exceeds"):
        DecodeGraphRunner(engine.model, backend, engine.device, [4, 16], engine.context_length)
    # A batch of 7 first, so that stale ids sit where the next, smaller batch pads.
    big = ForwardBatch.build(list(range(7)), [5] * 7, [1] * 7, "cpu")
    runner.load_inputs(big, torch.arange(100, 107), 8)
    batch = ForwardBatch.build([2, 0, 5], [10, 3, 7], [1, 1, 1], "cpu")
    static = runner.load_inputs(batch, torch.tensor([11, 12, 13]), 4)
    assert static.static and static.is_decode and static.index_width == engine.context_length
    assert static.req_rows.tolist() == [2, 0, 5, 8] and static.req_rows_cpu == [2, 0, 5, 8]
    assert static.positions.tolist() == [10, 3, 7, 0] and static.prefix_lens.tolist() == [10, 3, 7, 0]
    assert static.extend_lens.tolist() == [1] * 4 and static.token_req.tolist() == [0, 1, 2, 3]
    assert static.seq_lens_cpu == [11, 4, 8, 1]
    assert runner.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert int(runner._meta[12]) == 3  # real rows
    # The views are the static buffers themselves (what a graph captured), the same for every step.
    again = runner.load_inputs(batch, torch.tensor([1, 2, 3]), 4)
    assert again.positions.data_ptr() == static.positions.data_ptr()
    assert again.req_rows.data_ptr() == static.req_rows.data_ptr()
    # Padded top-k rows are masked once the mask is set (as the captured forward sets it).
    static.pad_mask = runner._arange[:4] >= runner._meta[12:13]
    topk = torch.zeros(4, 3, dtype=torch.int32)
    assert static.mask_padded_topk(topk)[:, 0].tolist() == [0, 0, 0, -1]
    # The indexer's query lengths give a padded row no position, so the top-k rule selects nothing for it (all -1)
    # with no mask in the layers; the real rows keep theirs.
    assert static.indexer_query_lens().tolist() == [11, 4, 8, 0]
    assert ForwardBatch.build([2, 0], [10, 3], [1, 1], "cpu").indexer_query_lens().tolist() == [11, 4]
    keys, scales = quantize_index_keys(torch.randn(64, 128))
    table = torch.randperm(64)[:48].view(4, 12).to(torch.int32)
    picked = indexer_topk(torch.randn(4, 2, 128), torch.rand(4, 2), keys, scales, table, static.token_req,
                          static.indexer_query_lens(), 6)
    assert picked[3].tolist() == [-1] * 6 and picked[1].tolist() == [0, 1, 2, 3, -1, -1]
    assert sorted(picked[0].tolist()) == picked[0].tolist() and min(picked[0].tolist()) >= 0
    assert static.token_table_width() == engine.context_length
    with pytest.raises(ValueError, match="decode"):
        runner.run(ForwardBatch.build([1], [3], [2], "cpu"), torch.tensor([1, 2]))
    # Larger than every bucket: the engine runs it eagerly, unpadded.
    assert runner.run(ForwardBatch.build([0] * 9, [1] * 9, [1] * 9, "cpu"), torch.zeros(9, dtype=torch.int64)) is None


def test_scratch_rows_of_every_pool(make_engine) -> None:
    dense = make_engine(max_running_requests=8).kv.cache
    assert dense.kv.shape[1] == dense.allocator.num_slots + SCRATCH_SLOTS
    assert dense.tokens.table.shape[0] == 9 and int(dense.tokens.table[8, 0]) == dense.scratch_slot
    assert (dense.tokens.table[8, 1:] == -1).all()
    co = make_engine(enable_hisparse=True, max_running_requests=8).kv
    bufs = co.buffers
    n_dev = bufs.num_buffers * bufs.slots_per_buffer
    assert bufs.kv.shape[1] == n_dev + SCRATCH_SLOTS and bufs.buffer_slots[8].tolist()[:2] == [n_dev, -1]
    assert bufs.buffer_tokens.shape[1] == bufs.lru_order.shape[1] == 9
    assert int(co.indexer.rows.table[8, 0]) == co.indexer.rows.allocator.num_slots
    assert co.indexer.keys.shape[1] == co.indexer.rows.allocator.num_slots + SCRATCH_SLOTS
    assert co.host.rows.table.shape[0] == 9 and (co.host.rows.table[8] == -1).all()
    assert co.is_empty()
