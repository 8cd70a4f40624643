# ruff: noqa  -- kept as it ran (from bench_tmp/), issue 23 item 2 anchor, 2026-11-28
"""Build the transcribed SGLang top-k as a torch extension (system g++: the image's default links libstdc++
statically into extensions, see benchmarks/results/deepgemm_anchor_2026-11-28)."""
import time

from torch.utils.cpp_extension import load

start = time.time()
load(name="sgl_topk", sources=["bench_tmp/sgl/topk.cu", "bench_tmp/sgl/binding.cpp"],
     build_directory="/tmp/sgl_build", extra_cflags=["-O3", "-std=c++17"],
     extra_cuda_cflags=["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a"], verbose=False)
print(f"sgl_topk built in {time.time() - start:.0f} s", flush=True)
