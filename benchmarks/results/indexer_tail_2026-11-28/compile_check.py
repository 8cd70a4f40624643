# ruff: noqa  -- kept as it ran (CPU, 2026-11-28), a one-off check
import sys
sys.path.insert(0, ".")
sys.path.insert(0, "tests/kernels")
sys.path.insert(0, "benchmarks/results/indexer_tail_2026-11-28")
import triton_cpu_checks as t
import scores_tail as S
from kernels.indexer_fast import _scores_kernel
base = {"q_ptr": "*u8", "w_ptr": "*fp32", "keys_ptr": "*u8", "scales_ptr": "*fp32", "rows_ptr": "*i32", "req_ptr": "*i64",
        "lens_ptr": "*i64", "out_ptr": "*fp32", "stride_qt": "i32", "stride_qh": "i32", "stride_wt": "i32",
        "stride_keys": "i32", "stride_rows_b": "i32", "stride_rows_l": "i32", "stride_out": "i32", "num_heads": "i32",
        "max_len": "i32", "blocks_per_prog": "i32"}
al = [n for n in base if n.endswith("_ptr")] + ["stride_qt", "stride_qh", "stride_keys", "stride_out", "stride_rows_b"]
k = t._compile_sm90(_scores_kernel, base, {"HEADS_P": 64, "BLOCK_N": 64, "PRECISION": 2, "Q_E4M3": True, "stride_rows_l": 1}, al, 4, 5)
print("product", t._resources(k), sum(t._main_loop_ops(k).values()))
for first in (False, True):
    k = t._compile_sm90(S._scores_timed, dict(base, ts_ptr="*i64"), {"HEADS_P": 64, "BLOCK_N": 64, "FIRST": first, "stride_rows_l": 1}, al + ["ts_ptr"], 4, 5)
    print("timed", first, t._resources(k), sum(t._main_loop_ops(k).values()))
qb = {n: v for n, v in base.items() if n != "blocks_per_prog"} | {"counter_ptr": "*i32", "num_q": "i32", "spans": "i32", "num_programs": "i32"}
for chunk in (2, 4, 8):
    k = t._compile_sm90(S._scores_queue, qb, {"HEADS_P": 64, "BLOCK_N": 64, "CHUNK": chunk, "stride_rows_l": 1}, al + ["counter_ptr"], 4, 5)
    ops = t._main_loop_ops(k)
    print("queue", chunk, t._resources(k), sum(ops.values()), ops.get("LDGSTS"))
import scores_pf as P
for pf, spf, bulk in ((0, 0, 0), (4, 0, 0), (4, 0, 1), (0, 4, 1), (4, 4, 1)):
    k = t._compile_sm90(P._scores_pf, base, {"HEADS_P": 64, "BLOCK_N": 64, "PF": pf, "START_PF": spf, "BULK": bulk, "stride_rows_l": 1}, al, 4, 5)
    ops = t._main_loop_ops(k)
    pfo = {o: n for o, n in ops.items() if "CCTL" in o or "PF" in o or o.startswith("LDG") or o.startswith("LDGSTS")}
    print("pf", pf, spf, bulk, t._resources(k), sum(ops.values()), pfo)
