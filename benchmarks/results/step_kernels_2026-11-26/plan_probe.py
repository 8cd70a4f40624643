"""Hit-only swap-in calls (B 64, D 4096, K 2048) for ncu to profile the plan kernel."""
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_swap_in import NUM_RECENT, make_workload, random_pinned  # noqa: E402

from kernels.swap_in_cuda import swap_in_cuda  # noqa: E402
from kernels.swap_in_tables import SwapInTables  # noqa: E402

batch, D, K = int(sys.argv[1]), 4096, 2048
seq_len = int(sys.argv[2]) if len(sys.argv) > 2 else 4 * D
miss = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
dev = "cuda"
host_pool = random_pinned(1 << 16, 1152)
width = D + NUM_RECENT
device_pool = torch.empty((batch * width, 1152), dtype=torch.uint8, device=dev)
slots = torch.randperm(batch * width, device=dev).to(torch.int32).reshape(batch, width)
host_rows = torch.randint(0, host_pool.shape[0], (batch, seq_len), dtype=torch.int32, device=dev)
seq_lens = torch.full((batch,), seq_len, dtype=torch.int64, device=dev)
req_rows = torch.arange(batch, dtype=torch.int64, device=dev)
topk, tokens, lru, _ = make_workload(batch, D, K, miss, seq_len)
counters = torch.zeros(2, dtype=torch.int64, device=dev)
t0, l0 = tokens.clone(), lru.clone()
tables = SwapInTables(slots, tokens, lru, host_rows, host_pool, device_pool, NUM_RECENT, counters)
for _ in range(8):
    tokens.copy_(t0)
    lru.copy_(l0)
    swap_in_cuda(topk, seq_lens, req_rows, tables)
torch.cuda.synchronize()
print("ok", counters.tolist())
