# ruff: noqa  -- kept as it ran
"""After bench_decode.main returns in-process: which live CUDA tensors hold the memory, and who refers to them."""
import gc, importlib.util, sys, types
from pathlib import Path
import torch
ROOT = Path.cwd()
spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "benchmarks" / "bench_decode.py")
bench = importlib.util.module_from_spec(spec); spec.loader.exec_module(bench)
argv = ["--contexts", "16384", "--steps", "3", "--warmup", "1", "--device-kv-budget-gib", "1",
        "--host-kv-budget-gib", "4", "--max-batch", "16", "--miss-rates", "0.15", "--out", "/tmp/r.json"]
torch.cuda.memory._record_memory_history(max_entries=200000)
assert bench.main(argv) == 0
gc.collect(); torch.cuda.synchronize()
print("ALLOCATED", torch.cuda.memory_allocated())
snap = torch.cuda.memory._snapshot()
for seg in snap["segments"]:
    for b in seg["blocks"]:
        if b["state"] != "active_allocated": continue
        fr = b.get("frames", [])
        print("BLOCK", b["size"], "pool", seg.get("segment_pool_id"), "stream", seg.get("stream"))
        for f in [f for f in fr if "site-packages/torch" not in f["filename"] and "python3" not in f["filename"]][:10]:
            print("    ", f["filename"].replace(str(ROOT), ""), f["line"], f["name"])
