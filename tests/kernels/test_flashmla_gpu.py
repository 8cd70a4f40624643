"""FlashMLA (the `sgl-flash-mla` wheel) as the sparse MLA decode kernel, against the PyTorch reference, with every
unused slot NaN-poisoned; and the `flashmla` dispatcher's per-shape choice between FlashMLA and Triton."""

from __future__ import annotations

import pytest
import torch
from kernels_swap_traces import POISON

from kernels import pack_fp8_rows, sparse_mla_decode
from kernels.dispatch import sparse_mla_decode_rows_ref
from kernels.sparse_mla_flashmla import flashmla_available, page_size, sparse_mla_decode_flashmla
from kernels.sparse_mla_plan import FLASHMLA_MIN_BATCH

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not flashmla_available(), reason="needs a Hopper GPU and the sgl-flash-mla wheel"),
]

DEV = "cuda"
SCALE = 0.135234


def _poisoned_pool(rows: torch.Tensor, n_slots: int, fp8: bool, gen: torch.Generator):
    slots = torch.randperm(n_slots, generator=gen)[: rows.shape[0]]
    if fp8:
        pool = torch.full((n_slots, 656), POISON, dtype=torch.uint8)
        pool[slots] = pack_fp8_rows(rows)
    else:
        pool = torch.full((n_slots, 576), float("nan"), dtype=torch.bfloat16)
        pool[slots] = rows.bfloat16()
    return pool.to(DEV), slots


def _case(fp8: bool, heads: int, batch: int, top_k: int, n_slots_extra: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    n_rows = top_k + 300
    rows = torch.randn(n_rows, 576, generator=gen)
    pool, slots = _poisoned_pool(rows, 2 * n_rows + n_slots_extra, fp8, gen)
    logical = torch.stack([torch.randperm(n_rows, generator=gen)[:top_k] for _ in range(batch)])
    indices = slots[logical].to(torch.int32)
    indices[0, top_k // 3:] = -1  # ragged padding
    if batch > 2:
        indices[1, ::5] = -1
        indices[2] = -1  # all invalid
    q = torch.randn(batch, heads, 576, generator=gen).bfloat16().to(DEV)
    return q, pool, indices.to(DEV), gen, rows, logical


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize(("batch", "top_k", "extra"), [(1, 2048, 11), (3, 256, 64 * 9 - 600 + 128), (33, 512, 5)])
def test_flashmla_matches_reference(fp8: bool, heads: int, batch: int, top_k: int, extra: int) -> None:
    q, pool, indices, _, _, _ = _case(fp8, heads, batch, top_k, extra, heads + batch + top_k + fp8)
    out, lse = sparse_mla_decode_flashmla(q, pool, indices, SCALE)
    ref_out, ref_lse = sparse_mla_decode_rows_ref(q, pool, indices, SCALE)
    torch.cuda.synchronize()
    assert out.shape == (batch, heads, 512) and lse.shape == (batch, heads)
    assert torch.isfinite(out.float()).all(), "NaN from an unselected (poisoned) slot or an empty row"
    err = (out.float() - ref_out.float()).norm() / ref_out.float().norm()
    assert err < 1e-2, f"norm-relative error {err:.2e}"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-3, rtol=1e-4)
    if batch > 2:
        assert torch.equal(out[2].float(), torch.zeros_like(out[2].float())) and bool((lse[2] > 0).all())


@pytest.mark.parametrize("fp8", [True, False])
def test_flashmla_independent_of_slot_placement(fp8: bool) -> None:
    """Same rows in the same order at other slots (another page size too): bit-identical (HiSparse vs dense)."""
    gen = torch.Generator().manual_seed(77 + fp8)
    batch, heads, top_k = 5, 128, 1024
    rows = torch.randn(batch * top_k, 576, generator=gen)
    pool_a, slots_a = _poisoned_pool(rows, 3 * rows.shape[0], fp8, gen)  # page size 64
    pool_b, slots_b = _poisoned_pool(rows, 2 * rows.shape[0] + 6, fp8, gen)  # page size 2
    assert page_size(pool_a.shape[0]) == 64 and page_size(pool_b.shape[0]) == 2
    logical = torch.arange(batch * top_k).reshape(batch, top_k)
    idx_a, idx_b = slots_a[logical].to(torch.int32).to(DEV), slots_b[logical].to(torch.int32).to(DEV)
    idx_a[0, -100:] = -1
    idx_b[0, -100:] = -1
    q = torch.randn(batch, heads, 576, generator=gen).bfloat16().to(DEV)
    out_a, lse_a = sparse_mla_decode_flashmla(q, pool_a, idx_a, SCALE)
    out_b, lse_b = sparse_mla_decode_flashmla(q, pool_b, idx_b, SCALE)
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)


@pytest.mark.parametrize("fp8", [True, False])
def test_flashmla_dispatch_picks_per_batch(fp8: bool) -> None:
    """kernel="flashmla": our own kernel below the measured crossover batch (on Hopper the Gluon one), FlashMLA from
    it on; shapes FlashMLA does not take (16 heads) run our own kernel: the Gluon one padded to 64 heads with FP8
    rows, the Triton one with bf16 rows."""
    from kernels.sparse_mla_gluon import gluon_applies, sparse_mla_decode_gluon
    from kernels.sparse_mla_triton import sparse_mla_decode_triton

    def own_kernel(q, pool, indices, scale):
        run = sparse_mla_decode_gluon if gluon_applies(q, pool, indices) else sparse_mla_decode_triton
        return run(q, pool, indices, scale)

    threshold = FLASHMLA_MIN_BATCH[(128, fp8)]
    for batch, expect_flashmla in ((threshold - 1, False), (threshold, True)):
        if batch < 1:
            continue
        q, pool, indices, _, _, _ = _case(fp8, 128, batch, 512, 7, 3 + batch)
        got = sparse_mla_decode(q, pool, indices, SCALE, kernel="flashmla")
        expect = (sparse_mla_decode_flashmla if expect_flashmla else own_kernel)(q, pool, indices, SCALE)
        assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1])
    q, pool, indices, _, _, _ = _case(fp8, 16, 40, 512, 7, 99)
    got = sparse_mla_decode(q, pool, indices, SCALE, kernel="flashmla")
    expect = (sparse_mla_decode_gluon if fp8 else sparse_mla_decode_triton)(q, pool, indices, SCALE)
    assert torch.equal(got[0], expect[0])
