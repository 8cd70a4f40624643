"""Run in a fresh process: prefill one tiny-dsa prompt of N tokens, print peak RSS growth as JSON.

Usage: python long_prefill_probe.py N [CHUNK]. A fresh process keeps other tests' allocations out of the
measurement: growth = peak RSS during the prefill − RSS after loading the model and allocating the KV cache. The
kernel's high-water mark is reset at the baseline (``/proc/self/clear_refs``) so a transient peak while loading
cannot count as prefill memory; where that is refused the lifetime peak (getrusage) is used instead.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import torch
from dsa_test_helpers import dense_backend, forward_tokens

from decode_server.model import load_model


def current_rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def reset_peak_rss() -> bool:
    """Start a new high-water mark now (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


def peak_rss(since_reset: bool) -> int:
    if since_reset:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    length = int(sys.argv[1])
    chunk = int(sys.argv[2]) if len(sys.argv) > 2 else length
    model, config = load_model("tiny-dsa", "cpu", torch.float32)
    backend = dense_backend(config, num_slots=length + 64, max_requests=1, max_context=length + 64)
    backend.reserve(0, length)
    prompt = torch.randint(2, config.vocab_size, (length,), generator=torch.Generator().manual_seed(0)).tolist()
    baseline = current_rss()
    since_reset = reset_peak_rss()
    start = time.monotonic()
    for begin in range(0, length, chunk):
        hidden = forward_tokens(model, backend, [0], [begin], [prompt[begin : begin + chunk]])
    logits = model.compute_logits(hidden[-1:])
    peak = peak_rss(since_reset)
    print(json.dumps({"tokens": length, "chunk": chunk, "seconds": time.monotonic() - start,
                      "growth_bytes": peak - baseline, "finite": bool(torch.isfinite(logits).all())}))


if __name__ == "__main__":
    main()
