"""Compile-time figures without a GPU (Triton's LLVM and ptxas for sm_90, as tests/kernels/triton_cpu_checks.py
does): the paged TMA scores kernel's resources, what its main loop loads and how (TTGIR), and its SASS instruction
count, next to the engine's gather kernel (e4m3 q, the default launch: BLOCK_N 64, 4 warps, 5 stages).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/results/indexer_paged_tma_2026-11-27/compile_stats.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, "tests/kernels")
import triton_cpu_checks as checks  # noqa: E402
from scores_paged import _paged_scores_kernel  # noqa: E402

from kernels.indexer_fast import _scores_kernel  # noqa: E402

INTS = ("stride_qt", "stride_qh", "stride_wt", "stride_keys", "stride_rows_b", "stride_out", "num_heads", "max_len",
        "blocks_per_prog")


def stats(kernel, types: dict[str, str], constexprs: dict) -> str:
    types = {name: kind for name, kind in (types | {n: "i32" for n in INTS}).items() if name in kernel.arg_names}
    aligned = [n for n in types if n.endswith("_ptr")] + ["stride_qt", "stride_qh", "stride_wt", "stride_keys",
                                                          "stride_out", "num_heads"]
    compiled = checks._compile_sm90(kernel, types, constexprs, [n for n in aligned if n in types], 4, 5)
    main = [body for body in checks._loops(compiled.asm["ttgir"]) if "warp_group_dot" in body][0]
    ops = checks._main_loop_ops(compiled)
    return (f"{checks._resources(compiled)}; main loop: {main.count('tt.load')} synchronous loads, "
            f"{main.count('async_tma_copy')} TMA copies, {main.count('async_copy_global_to_local')} cp.async; "
            f"{sum(ops.values())} SASS instructions")


def main() -> None:
    common = {"q_ptr": "*u8", "w_ptr": "*fp32", "rows_ptr": "*i32", "req_ptr": "*i64", "lens_ptr": "*i64",
              "out_ptr": "*fp32"}
    print("gather (engine):", stats(_scores_kernel, common | {"keys_ptr": "*u8", "scales_ptr": "*fp32"},
                                    {"stride_rows_l": 1, "HEADS_P": 64, "BLOCK_N": 64, "PRECISION": 2, "Q_E4M3": True}))
    print("paged TMA:      ", stats(_paged_scores_kernel, common | {"keys_desc": "tensordesc<u8[64, 128]>",
                                                                    "scales_desc": "tensordesc<fp32[64]>"},
                                    {"stride_rows_l": 1, "HEADS_P": 64, "BLOCK_N": 64, "PDL": False}))
    print("paged TMA + PDL:", stats(_paged_scores_kernel, common | {"keys_desc": "tensordesc<u8[64, 128]>",
                                                                    "scales_desc": "tensordesc<fp32[64]>"},
                                    {"stride_rows_l": 1, "HEADS_P": 64, "BLOCK_N": 64, "PDL": True}))


if __name__ == "__main__":
    main()
