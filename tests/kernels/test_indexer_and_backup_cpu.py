"""CPU checks of the batched indexer (the GPU path's code, run on CPU) and of the CPU backup/argument checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import SwapInTables, backup_rows, indexer_topk
from kernels.indexer_gpu import indexer_topk_batched
from kernels.indexer_ref import indexer_topk_ref, quantize_index_keys
from kernels.swap_in_ref import swap_in_ref


def test_batched_indexer_matches_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    num_q, heads, n_keys, max_len, top_k = 7, 8, 600, 400, 32
    q = torch.randn(num_q, heads, 128, generator=gen)
    w = torch.rand(num_q, heads, generator=gen)
    keys, scales = quantize_index_keys(torch.randn(n_keys, 128, generator=gen))
    token_rows = torch.stack([torch.randperm(n_keys, generator=gen)[:max_len] for _ in range(3)]).to(torch.int32)
    token_req = torch.tensor([0, 1, 1, 2, 0, 2, 1])
    seq_lens = torch.tensor([400, 10, 32, 33, 150, 399, 1])
    expect = indexer_topk_ref(q, w, keys, scales, token_rows, token_req, seq_lens, top_k)
    assert torch.equal(indexer_topk_batched(q, w, keys, scales, token_rows, token_req, seq_lens, top_k), expect)
    assert torch.equal(indexer_topk(q, w, keys, scales, token_rows, token_req, seq_lens, top_k), expect)


def test_backup_rows_cpu_copies_all_layers() -> None:
    gen = torch.Generator().manual_seed(1)
    device_pool = torch.randint(0, 255, (3, 50, 24), dtype=torch.uint8, generator=gen)
    host_pool = torch.zeros(3, 80, 24, dtype=torch.uint8)
    src = torch.tensor([4, 0, 49])
    dst = torch.tensor([79, 3, 10])
    assert backup_rows(device_pool, host_pool, src, dst) is None
    assert torch.equal(host_pool[:, dst], device_pool[:, src])
    untouched = torch.ones(80, dtype=torch.bool)
    untouched[dst] = False
    assert int(host_pool[:, untouched].sum()) == 0
    with pytest.raises(ValueError):
        backup_rows(device_pool, host_pool[:, :, :8], src, dst)


def test_swap_in_rejects_bad_arguments() -> None:
    i32 = torch.int32
    batch = dict(top_k_tokens=torch.zeros(1, 4, dtype=i32), seq_lens=torch.tensor([10]), req_rows=torch.tensor([0]))
    tables = SwapInTables(
        buffer_slots=torch.zeros(1, 6, dtype=i32), buffer_tokens=torch.zeros(1, 4, dtype=i32),
        lru_order=torch.zeros(1, 4, dtype=i32), host_rows=torch.zeros(1, 16, dtype=i32),
        host_pool=torch.zeros(16, 8, dtype=torch.uint8), device_pool=torch.zeros(8, 8, dtype=torch.uint8),
        num_recent=2, counters=None,
    )
    with pytest.raises(ValueError, match="num_recent"):
        swap_in_ref(**batch, tables=dataclasses.replace(tables, num_recent=0))
    with pytest.raises(ValueError, match="D \\+ R"):
        swap_in_ref(**batch, tables=dataclasses.replace(tables, num_recent=3))
    with pytest.raises(ValueError, match="int32"):
        swap_in_ref(**{**batch, "top_k_tokens": torch.zeros(1, 4, dtype=torch.int64)}, tables=tables)
    with pytest.raises(ValueError, match="row_bytes"):
        swap_in_ref(**batch, tables=dataclasses.replace(tables, device_pool=torch.zeros(8, 4, dtype=torch.uint8)))
