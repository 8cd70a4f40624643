# ruff: noqa  -- kept as it ran
"""Where the memory a random build leaves stranded sits: per caching-allocator segment with free (inactive) blocks,
the allocations that keep it alive (their innermost decode_server frames)."""
import collections, gc, sys
import torch
from decode_server.model import build_random_model, load_config

name = sys.argv[1]
torch.cuda.memory._record_memory_history(max_entries=500000)
model = build_random_model(load_config(name), "cuda", torch.bfloat16, seed=0, quantization="auto")
torch.cuda.synchronize(); gc.collect(); torch.cuda.empty_cache()
snap = torch.cuda.memory._snapshot()

def where(block):
    frames = block.get("frames") or []
    own = [f for f in frames if "decode_server" in f["filename"] or "kernels/" in f["filename"]]
    f = own[:3]
    return " < ".join(f"{x['filename'].split('/')[-1]}:{x['line']}:{x['name']}" for x in f) or "?"

by_holder = collections.Counter(); by_freed = collections.Counter(); total = 0; segs = 0
for seg in snap["segments"]:
    free = sum(b["size"] for b in seg["blocks"] if b["state"] == "inactive")
    if free == 0:
        continue
    segs += 1; total += free
    holders = [b for b in seg["blocks"] if b["state"] == "active_allocated"]
    key = (seg["segment_type"], seg["total_size"] >> 20, where(holders[0]) if holders else "-")
    by_holder[key] += free
print(f"RESULT {name}: {total / 2**20:.1f} MiB free inside {segs} segments")
for key, free in by_holder.most_common(12):
    print(f"RESULT   {free / 2**20:8.1f} MiB  {key}")
# the frees that made the holes: last free events per address range are in device_traces
traces = snap.get("device_traces", [[]])[0]
freed = collections.Counter()
for e in traces:
    if e["action"] == "free_completed" and e["size"] >= (1 << 20):
        freed[where(e)] += e["size"]
for key, size in freed.most_common(10):
    print(f"RESULT   freed {size / 2**20:9.1f} MiB by {key}")
