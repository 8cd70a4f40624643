"""For the next GPU session (issue 23 item 6): the Gluon sparse MLA kernel (`mla_gluon.py`, bf16 rows) checked
against the float reference and the Triton kernel, then timed against FlashMLA and the Triton kernel (128 heads,
K 2048, B 64 and 128, L2 flushed before every call: bench_sparse_mla.bench). `--check` runs only the checks (run it
first, with a short timeout: a wrong barrier phase would hang, not fail).

    PYTHONPATH=$PWD python3 benchmarks/results/sparse_mla_gluon_2026-11-28/time_gpu.py --check
    PYTHONPATH=$PWD python3 benchmarks/results/sparse_mla_gluon_2026-11-28/time_gpu.py
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, "benchmarks")
from bench_sparse_mla import POOL_ROWS, SCALE, bench, make_pool  # noqa: E402
from mla_gluon import sparse_mla_gluon  # noqa: E402

from kernels.dispatch import sparse_mla_decode_rows_ref  # noqa: E402
from kernels.sparse_mla_flashmla import flashmla_applies, sparse_mla_decode_flashmla  # noqa: E402
from kernels.sparse_mla_triton import sparse_mla_decode_triton  # noqa: E402

VARIANTS_FIRST = {"gluon N32 S3": {"block_n": 32, "stages": 3}, "gluon N32 S4": {"block_n": 32, "stages": 4},
                  "gluon N64 S2": {"block_n": 64, "stages": 2},
                  "gluon N32 S3 dup": {"block_n": 32, "stages": 3, "dup_qk": True},
                  "gluon N32 S4 dup": {"block_n": 32, "stages": 4, "dup_qk": True}}
# Second call (after the first's timings): the classic order (gathers land during a whole tile's work) and P as the
# PV wgmmas' register operand (with DUP_QK), at 64- and 32-row tiles.
VARIANTS = {"gluon N64 S2": {"block_n": 64, "stages": 2},
            "gluon N64 S2 classic": {"block_n": 64, "stages": 2, "classic": True},
            "gluon N64 S2 classic dup": {"block_n": 64, "stages": 2, "classic": True, "dup_qk": True},
            "gluon N64 S2 classic dup preg": {"block_n": 64, "stages": 2, "classic": True, "dup_qk": True,
                                              "p_regs": True},
            "gluon N64 S2 dup preg": {"block_n": 64, "stages": 2, "dup_qk": True, "p_regs": True},
            "gluon N64 S2 classic dup preg lazy": {"block_n": 64, "stages": 2, "classic": True, "dup_qk": True,
                                                   "p_regs": True, "lazy_rescale": True},
            "gluon N32 S4 classic": {"block_n": 32, "stages": 4, "classic": True},
            "gluon N32 S4 classic dup preg": {"block_n": 32, "stages": 4, "classic": True, "dup_qk": True,
                                              "p_regs": True},
            "gluon N32 S4 dup preg": {"block_n": 32, "stages": 4, "dup_qk": True, "p_regs": True}}


def check() -> bool:
    """Each variant against the float reference (and the Triton kernel) on small cases: skipped entries, an
    all-skipped request, splits, 64 and 128 heads."""
    torch.manual_seed(1)
    pool = torch.randn(4096, 576, device="cuda").bfloat16()
    ok = True
    for batch, heads, top_k, splits in ((2, 64, 2048, 1), (3, 128, 2048, 4), (5, 128, 1024, 2), (1, 64, 256, 1)):
        q = torch.randn(batch, heads, 576, device="cuda").bfloat16()
        idx = torch.randint(0, pool.shape[0], (batch, top_k), device="cuda", dtype=torch.int32)
        idx[0, ::7] = -1
        if batch > 2:
            idx[2] = -1  # all skipped: zeros and lse +inf
        ref, ref_lse = sparse_mla_decode_rows_ref(q, pool, idx, SCALE)
        tri, _ = sparse_mla_decode_triton(q, pool, idx, SCALE)
        for name, kw in VARIANTS.items():
            if top_k % (kw["block_n"] * splits):
                continue
            try:
                out, lse = sparse_mla_gluon(q, pool, idx, SCALE, splits=splits, **kw)
                torch.cuda.synchronize()
            except Exception as exc:  # a compile or launch error: report, go on
                print(f"{name} B {batch} H {heads} K {top_k} s {splits}: {type(exc).__name__}: {str(exc)[:300]}")
                ok = False
                continue
            err = float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))
            err_tri = float((out.float() - tri.float()).norm() / tri.float().norm().clamp_min(1e-30))
            finite = torch.isfinite(ref_lse)
            lse_err = float((lse[finite] - ref_lse[finite]).abs().max())
            skipped_ok = bool(batch <= 2 or (torch.all(out[2] == 0) and torch.all(lse[2] == float("inf"))))
            good = err < 1e-2 and lse_err < 1e-3 and skipped_ok and bool(torch.isfinite(out).all())
            ok &= good
            print(f"{name} B {batch} H {heads} K {top_k} s {splits}: rel err {err:.2e} (vs Triton {err_tri:.2e}), "
                  f"lse {lse_err:.1e}, all-skipped {skipped_ok}: {'ok' if good else 'WRONG'}", flush=True)
    return ok


def timing() -> None:
    torch.manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    pool = make_pool("bf16")
    rows = []
    for batch in (64, 128):
        qs = [torch.randn(batch, 128, 576, device="cuda").bfloat16() for _ in range(2)]
        idx = [torch.randint(0, POOL_ROWS, (batch, 2048), device="cuda", dtype=torch.int32) for _ in range(2)]
        kernels = {"triton": lambda q, ix: sparse_mla_decode_triton(q, pool, ix, SCALE)}
        if flashmla_applies(qs[0], pool, idx[0]):
            kernels["flashmla"] = lambda q, ix: sparse_mla_decode_flashmla(q, pool, ix, SCALE)
        for name, kw in VARIANTS.items():
            kernels[name] = lambda q, ix, kw=kw: sparse_mla_gluon(q, pool, ix, SCALE, **kw)
        times = {}
        for name, fn in kernels.items():
            try:
                times[name] = bench(lambda i, fn=fn, qs=qs, idx=idx: fn(qs[i], idx[i]), 2, flush)
            except Exception as exc:
                print(f"B {batch} {name}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            print(f"B {batch} {name}: {times[name]:.1f} us", flush=True)
        rows.append((batch, times))
    print("\n| B | kernel | µs | FlashMLA / kernel |")
    for batch, times in rows:
        for name, us in times.items():
            print(f"| {batch} | {name} | {us:.1f} | {times.get('flashmla', float('nan')) / us:.2f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.check:
        sys.exit(0 if check() else 1)
    timing()
