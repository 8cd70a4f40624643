# Kept as it ran from bench_tmp/ (one H200: `timeout 200 python3 nccl_capture_check.py`; printed "captured collectives replay == eager: True | first eager differs (inputs changed): True").
"""One-rank NCCL group on one GPU: all_gather_into_tensor and reduce_scatter_tensor (DP attention's MLP collectives)
and all_reduce / all_gather (TP's) captured in a CUDA graph and replayed; results equal the eager calls."""
import os

import torch
import torch.distributed as dist

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29511")
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
x = torch.randn(64, 7168, device="cuda", dtype=torch.bfloat16)
gathered = torch.empty_like(x)
scattered = torch.empty_like(x)
summed = x.clone()


def body():
    dist.all_gather_into_tensor(gathered, x)
    dist.reduce_scatter_tensor(scattered, gathered * 2)
    summed.copy_(x)
    dist.all_reduce(summed)
    return scattered + summed


eager = body().clone()
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    body()
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
    out = body()
x.copy_(torch.randn_like(x))
g.replay()
torch.cuda.synchronize()
want = body()
print("captured collectives replay == eager:", torch.equal(out, want), "| first eager differs (inputs changed):",
      not torch.equal(out, eager))
dist.destroy_process_group()
