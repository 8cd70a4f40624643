"""FP8 656-byte rows round-trip, and the sparse MLA reference against a naive float64 computation."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import pack_fp8_rows, sparse_mla_decode, unpack_fp8_rows
from kernels.fp8_rows import FP8_ROW_BYTES
from kernels.sparse_mla_ref import sparse_mla_decode_ref


def test_fp8_round_trip_is_close_and_idempotent() -> None:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(37, 576, generator=g) * torch.logspace(-3, 2, 37).unsqueeze(1)
    packed = pack_fp8_rows(rows)
    assert packed.shape == (37, FP8_ROW_BYTES) and packed.dtype == torch.uint8
    back = unpack_fp8_rows(packed)
    # e4m3 has 3 mantissa bits: relative error per element <= 2^-4 of the tile's scale range.
    err = (back[:, :512] - rows[:, :512]).norm() / rows[:, :512].norm()
    assert err < 0.05
    assert torch.equal(back[:, 512:], rows[:, 512:].to(torch.bfloat16).float())
    scales = packed[:, 512:528].contiguous().view(torch.float32)
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales), "scales must be powers of two"
    assert torch.equal(unpack_fp8_rows(pack_fp8_rows(back)), back), "dequantized rows must re-pack exactly"


def naive_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float):
    batch, heads, _ = q.shape
    out = torch.zeros(batch, heads, 512, dtype=torch.float64)
    lse = torch.full((batch, heads), math.inf, dtype=torch.float64)
    for b in range(batch):
        sel = [int(i) for i in indices[b] if i >= 0]
        if not sel:
            continue
        rows = kv[sel].double()
        s = q[b].double() @ rows.T * scale
        lse[b] = torch.logsumexp(s, dim=-1)
        out[b] = torch.softmax(s, dim=-1) @ rows[:, :512]
    return out, lse


@pytest.mark.parametrize("fmt", ["float", "fp8"])
def test_sparse_mla_ref_matches_naive_with_poison_and_padding(fmt: str) -> None:
    g = torch.Generator().manual_seed(1)
    batch, heads, top_k, n = 4, 16, 64, 300
    q = torch.randn(batch, heads, 576, generator=g)
    rows = torch.randn(n, 576, generator=g)
    indices = torch.stack([torch.randperm(n, generator=g)[:top_k] for _ in range(batch)]).to(torch.int32)
    indices[1, 40:] = -1  # ragged padding
    indices[2, ::3] = -1  # holes
    indices[3] = -1  # all invalid
    used = indices[indices >= 0].long().unique()
    unused = torch.ones(n, dtype=torch.bool)
    unused[used] = False
    if fmt == "fp8":
        kv = pack_fp8_rows(rows)
        exact = unpack_fp8_rows(kv)
        kv[unused] = 0xFF  # NaN in e4m3, fp32 and bf16
    else:
        kv = rows.clone()
        kv[unused] = float("nan")
        exact = rows
    out, lse = sparse_mla_decode(q, kv, indices, 0.1)
    ref_out, ref_lse = naive_attention(q, exact, indices, 0.1)
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double(), ref_out, atol=1e-4, rtol=1e-4)
    assert torch.allclose(lse[:3].double(), ref_lse[:3], atol=1e-4, rtol=1e-5)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    assert torch.isinf(lse[3]).all() and (lse[3] > 0).all()


def test_result_depends_only_on_rows_not_slots() -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 16, 576, generator=g).bfloat16()
    rows = torch.randn(64, 576, generator=g).bfloat16()
    idx = torch.arange(64, dtype=torch.int32).repeat(2, 1)
    idx[1, 50:] = -1
    perm = torch.randperm(200, generator=g)[:64]
    pool = torch.full((200, 576), float("nan"), dtype=torch.bfloat16)
    pool[perm] = rows
    moved = torch.where(idx >= 0, perm[idx.clamp(min=0).long()].int(), -1)
    a = sparse_mla_decode_ref(q, rows, idx, 0.2)
    b = sparse_mla_decode_ref(q, pool, moved, 0.2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("fmt", ["float", "fp8"])
def test_reference_in_query_chunks_equals_one_call(fmt: str, monkeypatch) -> None:
    """The CPU reference bounds its gather by taking query rows in chunks; every row's output and lse must be
    bit-identical to taking all rows at once (the HiSparse == dense contract rests on per-row results)."""
    import kernels.dispatch as dispatch

    g = torch.Generator().manual_seed(3)
    batch, heads, top_k, pool = 23, 4, 16, 64
    q = torch.randn(batch, heads, 576, generator=g)
    rows = torch.randn(pool, 576, generator=g)
    kv = pack_fp8_rows(rows) if fmt == "fp8" else rows
    indices = torch.randint(0, pool, (batch, top_k), generator=g, dtype=torch.int32)
    indices[::3, -5:] = -1
    whole = dispatch.sparse_mla_decode_rows_ref(q, kv, indices, 0.05)
    monkeypatch.setattr(dispatch, "REF_GATHER_BUDGET_BYTES", top_k * 576 * 4 * 5)  # 5 query rows per call
    assert dispatch.reference_chunk_rows(top_k, 576) == 5
    chunked = dispatch.sparse_mla_decode_rows_ref(q, kv, indices, 0.05)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
