"""One launch of the default scores kernel (e4m3 q) at B 16, 32K after an L2-flushing read, for ncu."""
import argparse
import sys

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
import bench_indexer as bi  # noqa: E402

from kernels import indexer_fast as F  # noqa: E402

bench = bi.Bench(argparse.Namespace(layout="paged", flush="read", json=None))
q, w, keys, scales, token_rows, req, lens = bench.inputs(16, 32768, 1)
q8, w8 = F.quantize_query(q, w)
for _ in range(3):
    F.indexer_scores_fast(q8, w8, keys, scales, token_rows, req, lens)
torch.cuda.synchronize()
bench.flush_read()
F.indexer_scores_fast(q8, w8, keys, scales, token_rows, req, lens)
torch.cuda.synchronize()
