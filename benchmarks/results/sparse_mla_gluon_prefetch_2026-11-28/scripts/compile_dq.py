"""Compile the experiment kernels for sm_90 (no GPU): registers, spills, main-loop opcode mix.

    PYTHONPATH=$PWD python3 compile_dq.py gluon_dq 0 1 2 3     (DEQUANT variants; gluon_pf 1 2: PREFETCH variants)
run with this folder on the path (it ran from bench_tmp/)."""
# ruff: noqa: E402
import importlib
import os
import sys

sys.path.insert(0, "tests/kernels")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton_cpu_checks import _main_loop_ops, _resources

fn = importlib.import_module(sys.argv[1])._sparse_mla_gluon_kernel

names = fn.arg_names
types = {"q_ptr": "*bf16", "kv_ptr": "*u8", "kv_f32_ptr": "*fp32", "kv_bf16_ptr": "*bf16", "idx_ptr": "*i32",
         "out_ptr": "*bf16", "lse_ptr": "*fp32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
         "stride_qb": "i32", "stride_qh": "i32", "stride_kv": "i32", "stride_f32": "i32", "stride_bf16": "i32",
         "stride_ib": "i32", "num_heads": "i32", "top_k": "i32", "scale_log2": "fp32"}
aligned = [n for n in types if n.endswith("_ptr")] + ["stride_qb", "stride_qh", "stride_ib", "num_heads", "top_k", "stride_kv"]
for dq in [int(a) for a in sys.argv[2:]]:
    constexprs = {"BLOCK_H": 64, "BLOCK_N": 64, "TOKENS_PER_SPLIT": 2048, "NUM_SPLITS": 1, "FP8": True,
                  **({"DEQUANT": dq} if "DEQUANT" in names else {"PREFETCH": dq}), "num_warps": 8}
    src = GluonASTSource(fn=fn, signature={n: types.get(n, "constexpr") for n in names},
                         constexprs={(names.index(k),): v for k, v in constexprs.items()},
                         attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    ops = _main_loop_ops(k)
    print(f"DEQUANT {dq}: {_resources(k)}; loop {sum(ops.values())} instr;",
          ", ".join(f"{o} {n}" for o, n in ops.most_common(18)))
