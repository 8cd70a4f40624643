"""Scratch: host→device time of one layer's misses (pinned copy_, the PCIe floor), GLM-5 bench shapes."""
import statistics

import torch

for row_bytes in (1152, 656):
    for batch in (64, 128):
        nbytes = int(batch * 0.2 * 2048) * row_bytes
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        ts = []
        for i in range(12):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(src, non_blocking=True)
            e.record()
            e.synchronize()
            if i >= 2:
                ts.append(s.elapsed_time(e))
        ms = statistics.median(ts)
        print(f"FLOOR row {row_bytes} B {batch}: {nbytes / 1e6:.1f} MB per layer, copy_ {ms:.3f} ms ({nbytes / ms / 1e6:.1f} GB/s)")
