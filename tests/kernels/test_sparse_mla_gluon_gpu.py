"""The Gluon sparse MLA kernel (kernels/sparse_mla_gluon.py) on a Hopper GPU: against the reference (NaN-poisoned
pools, ragged and all-skipped requests, splits, both row formats), independent of slot placement (HiSparse ==
dense), the same bits in a CUDA graph, and what `sparse_mla_decode` routes to it."""

from __future__ import annotations

import pytest
import torch
from test_kernels_gpu import (
    _nan_poisoned_pool,
    assert_independent_of_slot_placement,
    assert_matches_sparse_mla_reference,
)

from kernels import sparse_mla_decode
from kernels.dispatch import sparse_mla_decode_rows_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs a Hopper GPU"),
]

DEV = "cuda"


def _case(fp8: bool, heads: int, batch: int, top_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    n_rows = top_k + 300
    rows = torch.randn(n_rows, 576, generator=gen)
    pool, slots = _nan_poisoned_pool(rows, 2 * n_rows + 11, fp8, gen)
    logical = torch.stack([torch.randperm(n_rows, generator=gen)[:top_k] for _ in range(batch)])
    indices = slots[logical].to(torch.int32)
    indices[0, top_k // 3:] = -1  # ragged padding
    if batch > 2:
        indices[1, ::5] = -1
        indices[2] = -1  # nothing selected
    q = torch.randn(batch, heads, 576, generator=gen).bfloat16().to(DEV)
    return q, pool, indices.to(DEV)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize(("batch", "top_k", "splits"), [(1, 2048, None), (3, 128, 1), (3, 128, 2), (17, 512, None),
                                                        (5, 1024, 4)])
def test_gluon_matches_reference(fp8: bool, heads: int, batch: int, top_k: int, splits: int | None) -> None:
    from kernels.sparse_mla_gluon import gluon_applies, sparse_mla_decode_gluon

    q, pool, indices = _case(fp8, heads, batch, top_k, heads * 31 + batch + top_k + fp8)
    assert gluon_applies(q, pool, indices)
    out, lse = sparse_mla_decode_gluon(q, pool, indices, 0.135, splits=splits)
    ref_out, ref_lse = sparse_mla_decode_rows_ref(q, pool, indices, 0.135)
    assert_matches_sparse_mla_reference(out, lse, ref_out, ref_lse, all_skipped_row=2 if batch > 2 else None)


@pytest.mark.parametrize(("fp8", "heads"), [(True, 16), (False, 16), (False, 32), (True, 32)])
@pytest.mark.parametrize(("batch", "top_k", "splits"), [(1, 2048, None), (3, 128, 2), (17, 512, None), (5, 1024, 4)])
def test_gluon_tp_rank_heads_padded_match_reference(fp8: bool, heads: int, batch: int, top_k: int,
                                                    splits: int | None) -> None:
    """A tensor-parallel rank's 16 / 32 heads run as one 64-head program (padding rows zero, not stored): against
    the reference (a real head's row left unwritten or written from a padding row would fail it), unsplit and
    split."""
    from kernels.sparse_mla_gluon import gluon_applies, gluon_can_run, sparse_mla_decode_gluon

    q, pool, indices = _case(fp8, heads, batch, top_k, heads * 37 + batch + top_k + fp8)
    assert gluon_can_run(q, pool, indices)
    assert gluon_applies(q, pool, indices) == (fp8 or heads == 32)  # bf16 at 16 heads: the Triton kernel is faster
    out, lse = sparse_mla_decode_gluon(q, pool, indices, 0.135, splits=splits)
    ref_out, ref_lse = sparse_mla_decode_rows_ref(q, pool, indices, 0.135)
    assert out.shape == (batch, heads, 512) and lse.shape == (batch, heads)
    assert_matches_sparse_mla_reference(out, lse, ref_out, ref_lse, all_skipped_row=2 if batch > 2 else None)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("batch", [1, 9])
def test_gluon_independent_of_slot_placement(fp8: bool, batch: int) -> None:
    """Same rows in the same order in other slots: the same bits (what HiSparse == dense rests on)."""
    from kernels.sparse_mla_gluon import sparse_mla_decode_gluon

    assert_independent_of_slot_placement(sparse_mla_decode_gluon, fp8, batch, 128, 7 + batch + fp8)


@pytest.mark.parametrize("fp8", [False, True])
def test_dispatch_runs_gluon_on_hopper_and_the_same_bits_in_a_graph(fp8: bool) -> None:
    """`sparse_mla_decode` (both attention backends' fallback) runs the Gluon kernel for 64 / 128 and 32 heads,
    for 16 with FP8 rows, the Triton kernel for 16 with bf16 rows; a captured graph replays the same bits as the
    eager call."""
    from kernels.sparse_mla_gluon import sparse_mla_decode_gluon
    from kernels.sparse_mla_triton import sparse_mla_decode_triton

    q, pool, indices = _case(fp8, 128, 6, 512, 99 + fp8)
    out, lse = sparse_mla_decode(q, pool, indices, 0.135)
    want_out, want_lse = sparse_mla_decode_gluon(q, pool, indices, 0.135)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    q16 = q[:, :16].contiguous()
    out16, _ = sparse_mla_decode(q16, pool, indices, 0.135)
    # 16 heads: padded Gluon with FP8 rows, the Triton kernel with bf16 rows (measured faster there).
    want16 = (sparse_mla_decode_gluon if fp8 else sparse_mla_decode_triton)(q16, pool, indices, 0.135)[0]
    assert torch.equal(out16, want16)
    q32 = q[:, :32].contiguous()
    assert torch.equal(sparse_mla_decode(q32, pool, indices, 0.135)[0],
                       sparse_mla_decode_gluon(q32, pool, indices, 0.135)[0])

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sparse_mla_decode(q, pool, indices, 0.135)  # warm-up (compiles) outside the capture
        with torch.cuda.graph(graph, stream=stream):
            g_out, g_lse = sparse_mla_decode(q, pool, indices, 0.135)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, want_out) and torch.equal(g_lse, want_lse)
