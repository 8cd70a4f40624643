"""Compile-time figures without a GPU (Triton's LLVM and ptxas for sm_90, as tests/kernels/triton_cpu_checks.py
does): the paged TMA scores kernel's resources, what its main loop loads and how (TTGIR), and its SASS instruction
count, next to the engine's gather kernel (e4m3 q, the default launch: BLOCK_N 64, 4 warps, 5 stages).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/results/indexer_paged_tma_2026-11-27/compile_stats.py
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, "tests/kernels")
import triton.backends.nvidia as nvidia  # noqa: E402
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
    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        lines = subprocess.run([tool, "-c", f.name], capture_output=True, text=True).stdout.splitlines()
    labels = {line.strip().rstrip(":"): i for i, line in enumerate(lines) if re.match(r"^\.L_x_\d+:", line.strip())}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA `\((\.L_x_\d+)\)", line)) and m.group(1) in labels and labels[m.group(1)] < i]
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    ops = collections.Counter(m.group(2) for line in lines[start:end + 1]
                              if (m := re.match(r"^\s*/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)", line)))
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
