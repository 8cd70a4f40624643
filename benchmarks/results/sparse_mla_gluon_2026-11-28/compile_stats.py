"""Compile the Gluon sparse MLA kernel (`mla_gluon.py`) for sm_90 without a GPU: registers, spills, shared memory
and the main loop's instruction mix, next to the Triton kernel's (bf16 rows, 128 heads' launch shape).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/results/sparse_mla_gluon_2026-11-28/compile_stats.py
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, "tests/kernels")
import importlib.util  # noqa: E402

import triton  # noqa: E402
import triton_cpu_checks as checks  # noqa: E402
from mla_gluon import _sparse_mla_gluon_kernel  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

TYPES = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
         "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "stride_qb": "i32", "stride_qh": "i32",
         "stride_kv": "i32", "stride_ib": "i32", "num_heads": "i32", "top_k": "i32", "scale_log2": "fp32"}


def _prescaled_stats():
    """The Triton kernel's figures come from sparse_mla_prescaled_2026-11-27/compile_stats.py (same file name)."""
    path = Path(__file__).resolve().parents[1] / "sparse_mla_prescaled_2026-11-27" / "compile_stats.py"
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("prescaled_compile_stats", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_gluon(block_n: int, stages: int, splits: int = 1, dup_qk: bool = False, lazy: bool = False,
                  classic: bool = False, p_regs: bool = False):
    fn = _sparse_mla_gluon_kernel
    names = fn.arg_names
    constexprs = {"BLOCK_H": 64, "BLOCK_N": block_n, "STAGES": stages, "TOKENS_PER_SPLIT": 2048 // splits,
                  "NUM_SPLITS": splits, "DUP_QK": dup_qk, "LAZY_RESCALE": lazy,
                  "CLASSIC": classic, "P_REGS": p_regs,
                  "num_warps": 8}
    signature = {name: TYPES.get(name, "constexpr") for name in names}
    aligned = [n for n in TYPES if n.endswith("_ptr") or n.startswith("stride") or n in ("num_heads", "top_k")]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = GluonASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                         attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 1})


def main_loop_mix(kernel) -> str:
    """Instruction count and the counts that matter of the longest loop of the kernel's SASS."""
    ops = checks._main_loop_ops(kernel)
    shown = ("HGMMA", "LDGSTS", "LDS", "STS", "BAR", "FMUL", "MUFU", "SHFL")
    return f"{sum(ops.values())} instructions (" + ", ".join(f"{name} {ops[name]}" for name in shown) + ")"


def main() -> None:
    for block_n, stages, dup_qk, lazy in ((32, 3, False, False), (32, 4, False, False), (64, 2, False, False),
                                          (32, 3, True, False), (32, 4, True, False), (32, 3, False, True),
                                          (32, 3, True, True)):
        name = f"gluon BLOCK_N {block_n} STAGES {stages}" + (" DUP_QK" if dup_qk else "") + (" LAZY" if lazy else "")
        try:
            kernel = compile_gluon(block_n, stages, dup_qk=dup_qk, lazy=lazy)
        except Exception as exc:  # report and go on: some shapes exceed shared memory
            print(f"{name}: {type(exc).__name__}: {str(exc)[:1500]}")
            continue
        print(f"{name}: {checks._resources(kernel)}; main loop {main_loop_mix(kernel)}")
    prescaled_stats = _prescaled_stats()
    print("triton bf16:", prescaled_stats.compile_stats(prescaled_stats._sparse_mla_decode_kernel, False,
                                                         {"BLOCK_H": 64, "BLOCK_N": 64, "TOKENS_PER_SPLIT": 2048,
                                                          "NUM_SPLITS": 1, "FP8": False}))


if __name__ == "__main__":
    main()
