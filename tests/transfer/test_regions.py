"""Run coalescing and region addressing (pure functions)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transfer.regions import MemoryRegion, coalesce_runs, run_entries


def test_coalesce_merges_only_when_both_sides_advance():
    assert coalesce_runs([], []) == []
    assert coalesce_runs([5], [9]) == [(5, 9, 1)]
    assert coalesce_runs([0, 1, 2, 3], [8, 9, 10, 11]) == [(0, 8, 4)]
    # source contiguous, destination jumps at a page boundary
    assert coalesce_runs([0, 1, 2, 3], [8, 9, 4, 5]) == [(0, 8, 2), (2, 4, 2)]
    # destination contiguous, source jumps
    assert coalesce_runs([0, 1, 7, 8], [0, 1, 2, 3]) == [(0, 0, 2), (7, 2, 2)]
    # going backwards never merges
    assert coalesce_runs([3, 2], [3, 2]) == [(3, 3, 1), (2, 2, 1)]
    with pytest.raises(ValueError, match="2 source rows but 1 destination"):
        coalesce_runs([0, 1], [0])


def test_coalesce_page_pattern_gives_one_run_per_page():
    rng = np.random.default_rng(0)
    pages = rng.permutation(64)
    dst = [int(p) * 16 + i for p in pages for i in range(16)]
    runs = coalesce_runs(list(range(len(dst))), dst)
    assert len(runs) <= 64 and sum(n for _, _, n in runs) == len(dst)
    # expanding the runs gives back the row mapping
    assert [(s + i, d + i) for s, d, n in runs for i in range(n)] == list(zip(range(len(dst)), dst, strict=True))


def test_region_from_torch_and_numpy_arrays():
    t = torch.zeros(3, 10, 41, dtype=torch.bfloat16)
    r = MemoryRegion.from_array("kv", t)
    assert (r.num_layers, r.num_rows, r.row_bytes, r.layer_stride_bytes) == (3, 10, 82, 820)
    assert r.address(2, 4) == t.data_ptr() + 2 * 820 + 4 * 82
    assert r.nbytes == t.numel() * 2
    scales = torch.zeros(3, 10, dtype=torch.float32)
    assert MemoryRegion.from_array("s", scales).row_bytes == 4
    a = np.zeros((2, 5, 100), dtype=np.uint8)[:, :, :64]  # rows not contiguous with each other
    with pytest.raises(ValueError, match="contiguous"):
        MemoryRegion.from_array("x", a)
    strided = np.zeros((2, 5 * 64 + 32), dtype=np.uint8)[:, : 5 * 64].reshape(2, 5, 64)  # padded layers are fine
    r = MemoryRegion.from_array("y", strided)
    assert r.layer_stride_bytes == 5 * 64 + 32 and r.nbytes == 5 * 64 + 32 + 5 * 64
    with pytest.raises(IndexError):
        r.address(0, 5)
    assert MemoryRegion.from_description("y", r.describe()) == r


def test_run_entries_cover_every_layer_and_check_bounds():
    src = MemoryRegion("kv", 1000, 2, 10_000, 8, 100)
    dst = MemoryRegion("kv", 50_000, 2, 4000, 8, 400)
    srcs, dsts, lens = run_entries(src, dst, [(0, 16, 4), (10, 0, 1)])
    assert srcs == [1000, 1080, 11000, 11080]
    assert dsts == [50_128, 50_000, 54_128, 54_000]
    assert lens == [32, 8, 32, 8]
    with pytest.raises(IndexError, match="outside"):
        run_entries(src, dst, [(99, 0, 2)])
    with pytest.raises(ValueError, match="differ"):
        run_entries(src, MemoryRegion("kv", 0, 2, 4000, 4, 400), [(0, 0, 1)])
