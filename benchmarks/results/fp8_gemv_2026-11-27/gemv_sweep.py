# ruff: noqa  -- kept as it ran on the device (2026-11-27), a one-off sweep
"""Scratch: an FP8 GEMV (M = 1) without tensor cores against the table's choice, the read floor and bf16 cuBLAS."""
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks")
from _timing import hbm_copy_gbps, time_graph_us  # noqa: E402

from kernels import fp8_gemm  # noqa: E402
from kernels.fp8_gemm_ref import fp8_linear_ref  # noqa: E402
from kernels.fp8_gemm_triton import _quantize_values, quantize_activations  # noqa: E402


@triton.jit
def gemv_kernel(x_ptr, xq_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, n, k, stride_wn, stride_wsn, stride_wsk,
                BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, PREQ: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    BK: tl.constexpr = GROUPS * 128
    offs = tl.arange(0, BK)
    acc = tl.zeros([BLOCK_N, BK], tl.float32)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    nb = (pid * BLOCK_N) // 128
    k_groups = tl.cdiv(k, 128)
    for kk in range(0, tl.cdiv(k, BK)):
        cols = kk * BK + offs
        k_ok = cols < k
        w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        g = kk * GROUPS + tl.arange(0, GROUPS)
        sw = tl.load(ws_ptr + nb * stride_wsn + g * stride_wsk, mask=g < k_groups, other=0.0)
        if PREQ:
            xq = tl.load(xq_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)
            sx = tl.load(xs_ptr + g, mask=g < k_groups, other=0.0)
            xs = tl.reshape(tl.reshape(xq, [GROUPS, 128]) * (sx * sw)[:, None], [BK])
        else:
            x = tl.load(x_ptr + cols, mask=k_ok, other=1.0).to(tl.float32)
            xq, sx = _quantize_values(tl.reshape(x, [GROUPS, 128]))
            xs = tl.reshape(xq.to(tl.float32) * (sx * sw)[:, None], [BK])
        acc += w * xs[None, :]
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)


def gemv(x, w, ws, block_n, groups, preq, warps):
    n, k = w.shape
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    if preq:
        xq, xs = quantize_activations(x)
    else:
        xq, xs = x, x
    gemv_kernel[(triton.cdiv(n, block_n),)](x, xq, xs, w, ws, out, n, k, w.stride(0), ws.stride(0), ws.stride(1),
                                             BLOCK_N=block_n, GROUPS=groups, PREQ=preq, num_warps=warps)
    return out


SHAPES = [(2240, 7168), (24576, 1536), (7168, 16384), (4096, 7168), (7168, 2048), (8192, 1536), (36864, 7168),
          (7168, 18432), (2048, 7168)]
VARIANTS = [(bn, g, pq, wp) for bn, g, pq, wp in [
    (8, 4, False, 4), (16, 4, False, 4), (32, 4, False, 4), (16, 2, False, 4), (32, 2, False, 8),
    (8, 4, True, 4), (16, 4, True, 4), (32, 4, True, 4), (16, 8, True, 8), (64, 2, True, 8)]]


def main():
    dev = torch.device("cuda")
    fp8_gemm.reset_tuner("table")
    copy = hbm_copy_gbps()
    print(torch.cuda.get_device_name(), f"copy {copy:.0f} GB/s")
    rows = []
    for n, k in SHAPES:
        nbytes = n * k
        copies = max(2, -(-200_000_000 // nbytes))
        ws_list = [(torch.randn(n, k, device=dev) * 0.05).to(torch.float8_e4m3fn) for _ in range(copies)]
        sc_list = [torch.rand(n // 128 + (n % 128 > 0), k // 128, device=dev) * 1e-2 + 1e-3 for _ in range(copies)]
        wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(max(2, copies // 2))]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ref = fp8_linear_ref(x.float(), ws_list[0], sc_list[0], (128, 128))
        words = [t.view(torch.int64).view(-1) for t in ws_list]
        sink = torch.zeros((), dtype=torch.int64, device=dev)
        res = {}
        res["read"] = time_graph_us(lambda i: torch.sum(words[i % copies], dim=0, out=sink), 2 * copies)
        res["table"] = time_graph_us(lambda i: fp8_gemm.fp8_linear(x, ws_list[i % copies], sc_list[i % copies]), 2 * copies)
        choice = fp8_gemm.tuner().records[-1].choice.label() if hasattr(fp8_gemm.tuner(), "records") else "?"
        res["bf16"] = time_graph_us(lambda i: torch.nn.functional.linear(x, wb[i % len(wb)]), 2 * len(wb))
        out_t = fp8_gemm.fp8_linear(x, ws_list[0], sc_list[0]).float()
        scale = ref.abs().max().item()
        errs = {"table": (out_t - ref).abs().max().item() / scale}
        for v in VARIANTS:
            name = f"bn{v[0]} g{v[1]} {'pq' if v[2] else 'fq'} w{v[3]}"
            try:
                o = gemv(x, ws_list[0], sc_list[0], *v).float()
                errs[name] = (o - ref).abs().max().item() / scale
                res[name] = time_graph_us(lambda i, v=v: gemv(x, ws_list[i % copies], sc_list[i % copies], *v), 2 * copies)
            except Exception as exc:  # noqa: BLE001
                print("fail", name, repr(exc)[:300])
        best = min((t, nm) for nm, t in res.items() if nm not in ("read", "table", "bf16"))
        rows.append((n, k, res, errs, best, choice))
        gb = lambda us: nbytes / us / 1e3  # noqa: E731
        print(f"N {n:6d} K {k:6d} ({nbytes/1e6:6.1f} MB): read {res['read']:6.1f} us ({gb(res['read']):5.0f} GB/s) "
              f"table {res['table']:6.1f} ({gb(res['table']):5.0f}) bf16 {res['bf16']:6.1f} ({2*gb(res['bf16']):5.0f}) "
              f"best gemv {best[0]:6.1f} ({gb(best[0]):5.0f}) [{best[1]}]  err table {errs['table']:.1e} gemv {errs[best[1]]:.1e}")
        print("    " + "  ".join(f"{nm}:{t:.1f}" for nm, t in res.items() if nm not in ("read", "table", "bf16")))
        del ws_list, sc_list, wb, words
        torch.cuda.empty_cache()
    tot = {key: sum(r[2][key] for r in rows) for key in ("read", "table", "bf16")}
    tot["best gemv"] = sum(r[4][0] for r in rows)
    for v in VARIANTS:
        name = f"bn{v[0]} g{v[1]} {'pq' if v[2] else 'fq'} w{v[3]}"
        if all(name in r[2] for r in rows):
            tot[name] = sum(r[2][name] for r in rows)
    print("sums (us):", "  ".join(f"{kk}: {vv:.1f}" for kk, vv in tot.items()))


main()
