"""The dense FP8 GEMM's table launches without split-K, HEAD's kernel (OLD_KERNEL: a copy of kernels/fp8_gemm_triton.py
from before the patch) against the patched one (first K tile the constant 0 without split-K), timed in CUDA graphs
over weight copies larger than the L2; the outputs compared bit for bit. `--dry`: list the entries only (CPU).

    OLD_KERNEL=/tmp/old_fp8_gemm_triton.py python3 benchmarks/results/dense_first_tile_2026-11-28/dense_compare.py
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from kernels import fp8_gemm_triton as new  # noqa: E402
from kernels.fp8_gemm_table import read_table, table_path  # noqa: E402


def load_old():
    spec = importlib.util.spec_from_file_location("old_fp8_kernel", os.environ["OLD_KERNEL"])
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_fp8_kernel"] = module
    spec.loader.exec_module(module)
    return module


def graph_us(fn, calls: int = 20, rounds: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def main() -> None:
    dry = "--dry" in sys.argv
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NVIDIA H200"
    table = read_table(table_path(name))
    entries = sorted((key, fields) for key, (backend, fields) in table.items()
                     if key[0] == "dense" and backend == "triton" and fields and fields.get("split_k", 1) == 1
                     and not fields.get("gemv_groups"))
    print(f"{name}: {len(entries)} dense table entries without split-K")
    if dry:
        for key, fields in entries:
            print(key, new.TritonGemmConfig(**fields).label())
        return
    old = load_old()
    total_old = total_new = 0.0
    mismatches = 0
    for (_, n, k, _, bucket, _), fields in entries:
        t_old, t_new, same, label = time_entry(old, n, k, bucket, fields)
        total_old += t_old
        total_new += t_new
        mismatches += not same
        print(f"dense N {n:6d} K {k:6d} M≤{bucket:5d} {label:34s} old {t_old:7.1f} new {t_new:7.1f} µs "
              f"({100 * (t_new / t_old - 1):+5.1f} %) same-bits={same}", flush=True)
    print(f"SUM old {total_old:.1f} new {total_new:.1f} µs ({100 * (total_new / total_old - 1):+.1f} %); "
          f"{mismatches} with different bits")


def time_entry(old, n: int, k: int, bucket: int, fields: dict) -> tuple[float, float, bool, str]:
    """(old µs, new µs, same bits, label) of one table entry's launch at M = its bucket."""
    dev = torch.device("cuda")
    config = new.TritonGemmConfig(**fields)
    old_config = old.TritonGemmConfig(**{f: v for f, v in fields.items()
                                         if f in old.TritonGemmConfig.__dataclass_fields__})
    copies = max(1, (64 << 20) // (n * k) + 1)  # > 50 MB of weights: each call reads from HBM
    ws = [(torch.randn(n, k, device=dev) * 0.3).to(torch.float8_e4m3fn) for _ in range(copies)]
    ss = [torch.rand((n + 127) // 128, (k + 127) // 128, device=dev) * 1e-2 + 1e-3 for _ in range(copies)]
    x = torch.randn(bucket, k, device=dev, dtype=torch.bfloat16)
    q, s = new.quantize_activations(x)
    a, a_s = (x, None) if config.fuse_quant else (q, s)
    turn = iter(range(1 << 30))

    def run(module, cfg):
        i = next(turn) % copies
        return module.fp8_gemm(a, a_s, bucket, ws[i], ss[i], torch.bfloat16, cfg)

    same = torch.equal(old.fp8_gemm(a, a_s, bucket, ws[0], ss[0], torch.bfloat16, old_config),
                       new.fp8_gemm(a, a_s, bucket, ws[0], ss[0], torch.bfloat16, config))
    return graph_us(lambda: run(old, old_config)), graph_us(lambda: run(new, config)), same, config.label()


if __name__ == "__main__":
    main()
