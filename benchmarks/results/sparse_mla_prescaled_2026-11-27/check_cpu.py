"""CPU check of `mla_prescaled.py` under Triton's interpreter (no GPU): the prescaled kernel against the float
reference (kernels/dispatch.sparse_mla_decode_rows_ref) and against the current Triton kernel, FP8 and bf16 rows,
with −1 (skipped) entries and one all-skipped request. Small shapes (16 heads, K 64); prints the relative errors.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/results/sparse_mla_prescaled_2026-11-27/check_cpu.py
"""
from __future__ import annotations

import sys
from pathlib import Path

from kernels import triton_interpret

triton_interpret.enable()  # before triton is imported
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mla_prescaled import sparse_mla_prescaled  # noqa: E402

from kernels.dispatch import sparse_mla_decode_rows_ref  # noqa: E402
from kernels.fp8_rows import pack_fp8_rows  # noqa: E402
from kernels.sparse_mla_triton import sparse_mla_decode_triton  # noqa: E402

SCALE = 576 ** -0.5
DTYPE = torch.float16  # the interpreter computes bf16 dots wrongly (mla_prescaled.py)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    batch, heads, top_k, pool_rows = 3, 16, 64, 300
    rows = torch.randn(pool_rows, 576, generator=gen) * torch.rand(pool_rows, 1, generator=gen) * 4
    q = (torch.randn(batch, heads, 576, generator=gen)).to(DTYPE)
    indices = torch.randint(0, pool_rows, (batch, top_k), generator=gen, dtype=torch.int32)
    indices[0, 5:40:3] = -1
    indices[2] = -1  # a request with nothing selected: out 0, lse +inf
    config = {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "SPLITS": 1}
    worst = 0.0
    for name, kv in (("fp8", pack_fp8_rows(rows)), ("float rows", rows.to(DTYPE))):
        ref_out, ref_lse = sparse_mla_decode_rows_ref(q, kv, indices, SCALE)
        cur_out, cur_lse = sparse_mla_decode_triton(q, kv, indices, SCALE, config)
        for scale_in in (0, 1) if name == "fp8" else (0,):
            out, lse = sparse_mla_prescaled(q, kv, indices, SCALE, block_h=16, block_n=16, num_warps=4,
                                            scale_in=scale_in)
            assert torch.equal(out[2], torch.zeros_like(out[2])) and bool(torch.isinf(lse[2]).all()), "all skipped"
            err_ref = rel(out[:2], ref_out[:2])
            err_cur = rel(out[:2], cur_out[:2])
            lse_err = float((lse[:2] - ref_lse[:2]).abs().max())
            print(f"{name} SCALE_IN {scale_in}: out vs reference {err_ref:.2e} (current kernel "
                  f"{rel(cur_out[:2], ref_out[:2]):.2e}), vs current {err_cur:.2e}; lse max |diff| {lse_err:.1e} "
                  f"(current {float((cur_lse[:2] - ref_lse[:2]).abs().max()):.1e})")
            worst = max(worst, err_ref)
    assert worst < 1e-2, worst
    print("ok")


if __name__ == "__main__":
    main()
