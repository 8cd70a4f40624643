# ruff: noqa: E402, I001
"""Compile-time resources of the Triton sparse MLA kernel for sm_90 by BLOCK_H and warps (CPU only: run from the
project root with `PYTHONPATH=$PWD python3 benchmarks/results/sparse_mla_triton_warps_2026-11-28/compile_stats.py`)."""
import sys
sys.path.insert(0, ".")
sys.path.insert(0, "tests/kernels")
import triton_cpu_checks as t
from kernels.sparse_mla_triton import _sparse_mla_decode_kernel as fn
types = {"q_ptr": "*bf16", "kv_ptr": "*u8", "kv_f32_ptr": "*fp32", "kv_bf16_ptr": "*bf16", "idx_ptr": "*i32",
         "out_ptr": "*bf16", "lse_ptr": "*fp32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
         "stride_qb": "i32", "stride_qh": "i32", "stride_kv": "i32", "stride_f32": "i32", "stride_bf16": "i32",
         "stride_ib": "i32", "num_heads": "i32", "top_k": "i32", "scale_log2": "fp32"}
aligned = [n for n in types if n.endswith("_ptr")] + ["stride_qb", "stride_qh", "stride_ib", "num_heads", "top_k", "stride_kv"]
for bh, nw in ((16, 4), (16, 8), (32, 4), (32, 8), (64, 8)):
    for fp8 in (True, False):
        if not fp8:
            types2 = dict(types, kv_ptr="*bf16", kv_f32_ptr="*bf16")
            al = aligned + ["stride_f32", "stride_bf16"]
        else:
            types2, al = types, aligned
        c = {"BLOCK_H": bh, "BLOCK_N": 64, "TOKENS_PER_SPLIT": 2048, "NUM_SPLITS": 1, "FP8": fp8, "ROPE_ALIGNED": fp8}
        k = t._compile_sm90(fn, types2, c, al, nw, 2)
        ops = t._main_loop_ops(k)
        print(f"BLOCK_H {bh} warps {nw} {'fp8' if fp8 else 'bf16'}: {t._resources(k)}; main loop {sum(ops.values())} instr, HMMA {ops['HMMA']}")
