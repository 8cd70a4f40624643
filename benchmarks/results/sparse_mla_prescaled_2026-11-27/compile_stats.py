"""Compile-time figures without a GPU (Triton's LLVM and ptxas for sm_90, as tests/kernels/triton_cpu_checks.py
does): registers, stack, shared memory and the main loop's SASS instruction mix of the current sparse MLA kernel
(bf16 and FP8 rows) and of the prescaled variant (`mla_prescaled.py`). Launch options as the engine's default at 128
heads: BLOCK_H 64, BLOCK_N 64, 8 warps, 2 stages, one split.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/results/sparse_mla_prescaled_2026-11-27/compile_stats.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, "tests/kernels")
import triton_cpu_checks as checks  # noqa: E402
from mla_prescaled import _prescaled_kernel  # noqa: E402

from kernels.sparse_mla_triton import _sparse_mla_decode_kernel  # noqa: E402

STRIDES = ("stride_qb", "stride_qh", "stride_kv", "stride_f32", "stride_bf16", "stride_ib", "num_heads", "top_k")


def compile_stats(kernel, fp8: bool, constexprs: dict) -> str:
    types = {"q_ptr": "*bf16", "kv_ptr": "*u8" if fp8 else "*bf16", "kv_f32_ptr": "*fp32" if fp8 else "*bf16",
             "kv_bf16_ptr": "*bf16", "idx_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
             "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "scale_log2": "fp32"}
    types |= {name: "i32" for name in STRIDES}
    types = {name: kind for name, kind in types.items() if name in kernel.arg_names}
    aligned = [name for name in types if name.endswith("_ptr")] + list(STRIDES)
    compiled = checks._compile_sm90(kernel, types, constexprs, aligned, 8, 2)
    ops = checks._main_loop_ops(compiled)
    shown = ("HGMMA", "LDGSTS", "LDS", "STS", "LDL", "STL", "F2F", "F2FP", "FMUL", "MUFU")
    return (f"{checks._resources(compiled)}; main loop {sum(ops.values())} instructions ("
            + ", ".join(f"{name} {ops[name]}" for name in shown) + ")")


def main() -> None:
    base = {"BLOCK_H": 64, "BLOCK_N": 64}
    current = base | {"TOKENS_PER_SPLIT": 2048, "NUM_SPLITS": 1}
    print("current bf16:", compile_stats(_sparse_mla_decode_kernel, False, current | {"FP8": False}))
    print("current fp8: ", compile_stats(_sparse_mla_decode_kernel, True, current | {"FP8": True}))
    for scale_in in (0, 1):
        print(f"prescaled fp8 (SCALE_IN {scale_in}):",
              compile_stats(_prescaled_kernel, True, base | {"FP8": True, "SCALE_IN": scale_in}))
    print("prescaled bf16:", compile_stats(_prescaled_kernel, False, base | {"FP8": False, "SCALE_IN": 0}))


if __name__ == "__main__":
    main()
