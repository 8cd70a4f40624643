"""Scratch: variants of the Triton sparse MLA decode kernel (issue 23 item 6), timed against the current one."""
from __future__ import annotations

import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks")
from bench_sparse_mla import POOL_ROWS, SCALE, bench, make_pool  # noqa: E402

from kernels.dispatch import sparse_mla_decode_rows_ref  # noqa: E402
from kernels.sparse_mla_triton import LOG2E, sparse_mla_decode_triton  # noqa: E402


@triton.jit
def _tile(kv_ptr, kv_f32_ptr, rows, valid, stride_kv, stride_f32, TILE: tl.constexpr, FP8: tl.constexpr,
          MMA16: tl.constexpr):
    offs = tl.arange(0, 128)
    if FP8:
        raw = tl.load(kv_ptr + rows[:, None] * stride_kv + TILE * 128 + offs[None, :], mask=valid[:, None], other=0)
        if MMA16:
            vals = raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        else:
            vals = raw.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        scale = tl.load(kv_f32_ptr + rows * stride_f32 + 128 + TILE, mask=valid, other=0.0)
    else:
        vals = tl.load(kv_ptr + rows[:, None] * stride_kv + TILE * 128 + offs[None, :], mask=valid[:, None],
                       other=0.0)
        scale = tl.full(rows.shape, 1.0, tl.float32)
    return vals, scale


@triton.jit
def _var_kernel(
    q_ptr, kv_ptr, kv_f32_ptr, kv_bf16_ptr, idx_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qh, stride_kv, stride_f32, stride_bf16, stride_ib,
    num_heads, top_k, scale_log2,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, MMA16: tl.constexpr,
    WS: tl.constexpr, LSTAGES: tl.constexpr, N_TILES: tl.constexpr,
):
    pid = tl.program_id(0)
    head_blocks = num_heads // BLOCK_H
    b = pid // head_blocks
    heads = (pid % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, 128)
    offs_r = tl.arange(0, 64)
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q0 = tl.load(q_rows + offs[None, :])
    q1 = tl.load(q_rows + 128 + offs[None, :])
    q2 = tl.load(q_rows + 256 + offs[None, :])
    q3 = tl.load(q_rows + 384 + offs[None, :])
    qr = tl.load(q_rows + 512 + offs_r[None, :])
    if MMA16:
        qmax = tl.maximum(tl.maximum(tl.max(tl.abs(q0.to(tl.float32)), 1), tl.max(tl.abs(q1.to(tl.float32)), 1)),
                          tl.maximum(tl.max(tl.abs(q2.to(tl.float32)), 1), tl.max(tl.abs(q3.to(tl.float32)), 1)))
        e = tl.where(qmax > 0, 13.0 - tl.floor(tl.log2(tl.where(qmax > 0, qmax, 1.0))), 0.0)
        qs = tl.exp2(e)
        q_inv = tl.exp2(-e)
        q0 = (q0.to(tl.float32) * qs[:, None]).to(tl.float16)
        q1 = (q1.to(tl.float32) * qs[:, None]).to(tl.float16)
        q2 = (q2.to(tl.float32) * qs[:, None]).to(tl.float16)
        q3 = (q3.to(tl.float32) * qs[:, None]).to(tl.float16)
    acc0 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for tile in tl.range(0, N_TILES, num_stages=LSTAGES, warp_specialize=WS):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + b.to(tl.int64) * stride_ib + offs_n)
        valid = idx >= 0
        rows = tl.where(valid, idx, 0).to(tl.int64)
        k0, s0 = _tile(kv_ptr, kv_f32_ptr, rows, valid, stride_kv, stride_f32, 0, FP8, MMA16)
        k1, s1 = _tile(kv_ptr, kv_f32_ptr, rows, valid, stride_kv, stride_f32, 1, FP8, MMA16)
        k2, s2 = _tile(kv_ptr, kv_f32_ptr, rows, valid, stride_kv, stride_f32, 2, FP8, MMA16)
        k3, s3 = _tile(kv_ptr, kv_f32_ptr, rows, valid, stride_kv, stride_f32, 3, FP8, MMA16)
        if FP8:
            kr = tl.load(kv_bf16_ptr + rows[:, None] * stride_bf16 + 264 + offs_r[None, :], mask=valid[:, None],
                         other=0.0)
            scores = tl.dot(q0, tl.trans(k0)) * s0[None, :]
            scores += tl.dot(q1, tl.trans(k1)) * s1[None, :]
            scores += tl.dot(q2, tl.trans(k2)) * s2[None, :]
            scores += tl.dot(q3, tl.trans(k3)) * s3[None, :]
            if MMA16:
                scores = scores * q_inv[:, None]
        else:
            kr = tl.load(kv_ptr + rows[:, None] * stride_kv + 512 + offs_r[None, :], mask=valid[:, None], other=0.0)
            scores = tl.dot(q0, tl.trans(k0))
            scores = tl.dot(q1, tl.trans(k1), scores)
            scores = tl.dot(q2, tl.trans(k2), scores)
            scores = tl.dot(q3, tl.trans(k3), scores)
        scores = tl.dot(qr, tl.trans(kr), scores)
        scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc0 = acc0 * alpha[:, None]
        acc1 = acc1 * alpha[:, None]
        acc2 = acc2 * alpha[:, None]
        acc3 = acc3 * alpha[:, None]
        if FP8:
            acc0 = tl.dot((p * s0[None, :]).to(k0.dtype), k0, acc0)
            acc1 = tl.dot((p * s1[None, :]).to(k0.dtype), k1, acc1)
            acc2 = tl.dot((p * s2[None, :]).to(k0.dtype), k2, acc2)
            acc3 = tl.dot((p * s3[None, :]).to(k0.dtype), k3, acc3)
        else:
            pb = p.to(k0.dtype)
            acc0 = tl.dot(pb, k0, acc0)
            acc1 = tl.dot(pb, k1, acc1)
            acc2 = tl.dot(pb, k2, acc2)
            acc3 = tl.dot(pb, k3, acc3)
        m_i = m_new
    has = l_i > 0.0
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    bh = b.to(tl.int64) * num_heads + heads
    o_rows = out_ptr + bh[:, None] * 512
    tl.store(o_rows + offs[None, :], (acc0 * inv[:, None]).to(out_ptr.dtype.element_ty))
    tl.store(o_rows + 128 + offs[None, :], (acc1 * inv[:, None]).to(out_ptr.dtype.element_ty))
    tl.store(o_rows + 256 + offs[None, :], (acc2 * inv[:, None]).to(out_ptr.dtype.element_ty))
    tl.store(o_rows + 384 + offs[None, :], (acc3 * inv[:, None]).to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + bh, tl.where(has, lse2 * 0.6931471805599453, float("inf")))


def run_var(q, kv, idx, scale, block_h=64, block_n=64, warps=8, stages=2, mma16=False, ws=False, lstages=2):
    batch, heads, _ = q.shape
    fp8 = kv.dtype == torch.uint8
    out = torch.empty((batch, heads, 512), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads), dtype=torch.float32, device=q.device)
    kv_f32 = kv.view(torch.float32) if fp8 else kv
    kv_bf16 = kv.view(torch.bfloat16) if fp8 else kv
    _var_kernel[(batch * heads // block_h,)](
        q, kv, kv_f32, kv_bf16, idx, out, lse, q.stride(0), q.stride(1), kv.stride(0), kv_f32.stride(0),
        kv_bf16.stride(0), idx.stride(0), heads, idx.shape[1], float(scale) * LOG2E,
        BLOCK_H=block_h, BLOCK_N=block_n, FP8=fp8, MMA16=mma16, WS=ws, LSTAGES=lstages, N_TILES=idx.shape[1] // block_n,
        num_warps=warps, num_stages=stages)
    return out, lse


VARIANTS = {
    "base-var": {},
    "w16": {"warps": 16},
    "w16-n128": {"warps": 16, "block_n": 128},
    "n32-s3": {"block_n": 32, "lstages": 3, "stages": 3},
    "n32-s4": {"block_n": 32, "lstages": 4, "stages": 4},
    "w16-n32-s3": {"warps": 16, "block_n": 32, "lstages": 3, "stages": 3},
    "ls3": {"lstages": 3, "stages": 3},
    "ws": {"ws": True},
    "ws-w4": {"ws": True, "warps": 4},
    "mma16": {"mma16": True},
    "mma16-w16": {"mma16": True, "warps": 16},
}


def main() -> None:
    torch.manual_seed(0)
    rows = []
    for fmt in ("bf16", "fp8"):
        pool = make_pool(fmt)
        for batch in (64,):
            heads, top_k = 128, 2048
            qs = [torch.randn(batch, heads, 576, device="cuda").bfloat16() for _ in range(4)]
            idx = [torch.randint(0, POOL_ROWS, (batch, top_k), device="cuda", dtype=torch.int32) for _ in range(4)]
            flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
            ref, ref_lse = sparse_mla_decode_rows_ref(qs[0], pool, idx[0], SCALE)
            cur_out, _ = sparse_mla_decode_triton(qs[0], pool, idx[0], SCALE)
            cur = bench(lambda i, qs=qs, pool=pool, idx=idx: sparse_mla_decode_triton(qs[i], pool, idx[i], SCALE), 4,
                        flush)
            err = float((cur_out.float() - ref.float()).norm() / ref.float().norm())
            rows.append((fmt, batch, "current", cur, err, ""))
            print(f"{fmt} B{batch} current {cur:.1f} us err {err:.2e}", flush=True)
            for name, kw in VARIANTS.items():
                if name.startswith("mma16") and fmt != "fp8":
                    continue
                t0 = time.time()
                try:
                    out, lse = run_var(qs[0], pool, idx[0], SCALE, **kw)
                    torch.cuda.synchronize()
                    e = float((out.float() - ref.float()).norm() / ref.float().norm())
                    same = bool(torch.equal(out, cur_out))
                    us = bench(lambda i, kw=kw, qs=qs, pool=pool, idx=idx: run_var(qs[i], pool, idx[i], SCALE, **kw), 4,
                               flush)
                    rows.append((fmt, batch, name, us, e, "same" if same else ""))
                    print(f"{fmt} B{batch} {name} {us:.1f} us err {e:.2e} same={same} ({time.time() - t0:.0f}s)",
                          flush=True)
                except Exception as exc:  # noqa: BLE001
                    rows.append((fmt, batch, name, float("nan"), float("nan"), type(exc).__name__))
                    print(f"{fmt} B{batch} {name} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        del pool
        torch.cuda.empty_cache()
    print("\n| fmt | B | variant | us | rel err | note |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:.2e} | {r[5]} |")




def flashmla_rows() -> None:
    try:
        from bench_sparse_mla import flashmla_compare
        for fmt in ("bf16", "fp8"):
            pool = make_pool(fmt)
            for r in flashmla_compare(pool, fmt, 128, 2048, [64, 128]):
                print(f"FLASHMLA {fmt} B{r['batch']} flashmla {r['flashmla_us']:.1f} us triton {r['triton_us']:.1f} us")
            del pool
            torch.cuda.empty_cache()
    except Exception as exc:  # noqa: BLE001
        print("flashmla unavailable:", exc)


if __name__ == "__main__":
    if "--flashmla" in sys.argv:
        flashmla_rows()
    main()
