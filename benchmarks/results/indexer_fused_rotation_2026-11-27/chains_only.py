"""Scratch: bench_indexer's chains table alone (the branch's tree)."""
import argparse
import sys

sys.argv = ["bench_indexer.py"]
sys.path.insert(0, "benchmarks")
import bench_indexer as bi  # noqa: E402
import torch  # noqa: E402

b = bi.Bench(argparse.Namespace(layout="paged", flush="read", json=None, smoke=False, configs=False, no_main=True))
b.report.hbm_copy_gbps = bi.hbm_copy_gbps()
for batch in (1, 16, 64):
    for length in (8192, 32768, 131072):
        b.guarded(f"chain {batch} {length}", lambda b_=batch, n=length: b.chain_case(b_, n, b.inputs(b_, n, 3)))
torch.cuda.synchronize()
for c in b.report.chains:
    print(f"{c.batch:3d} {c.length:6d} | float q {c.float_q_us:7.1f} e4m3 q {c.e4m3_q_us:7.1f} one-kernel {c.one_kernel_q_us:7.1f} | "
          f"keys {c.keys_separate_us:5.1f} {c.keys_one_kernel_us:5.1f}")
b.print_errors()
