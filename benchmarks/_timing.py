"""Shared GPU timing helpers for the kernel benchmarks (CUDA events, warm-up, median)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

# ~0.5 ms of spinning at ~2 GHz: enough for the host to enqueue the timed call behind it, so that launch
# overhead on the host is not counted as GPU time.
_SPIN_CYCLES = 1_000_000


def time_gpu_us(fn: Callable[[], object], reset: Callable[[], object] | None = None, warmup: int = 3,
                iters: int = 20) -> float:
    """Median GPU time of `fn` in microseconds. `reset` (untimed) runs before every call, e.g. to restore
    tables that `fn` mutates; a GPU spin between them keeps host-side launch cost out of the measurement."""
    times = []
    for i in range(warmup + iters):
        if reset is not None:
            reset()
        torch.cuda._sleep(_SPIN_CYCLES)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def time_graph_us(fn: Callable[[int], object], calls: int, replays: int = 5) -> float:
    """Median GPU time per call of `calls` calls fn(0) … fn(calls-1) captured in one CUDA graph and replayed (no
    host launch cost, as the decode step's graphs run). fn(i) should rotate over inputs (e.g. weight copies) so
    that the L2 cache does not flatter it. The calls run twice eagerly first (compilation, autotuning)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            for i in range(calls):
                fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    del graph
    return statistics.median(times)


def hbm_copy_gbps(num_bytes: int = 1 << 30, iters: int = 5) -> float:
    """Device memory bandwidth of a plain device-to-device copy_ (bytes read + written per second, GB/s)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = time_gpu_us(lambda: dst.copy_(src), iters=iters)
    return 2 * num_bytes / (us * 1e-6) / 1e9


def pinned_h2d_gbps(num_bytes: int, iters: int = 10) -> float:
    """Bandwidth of one pinned host → device copy_ of `num_bytes` (GB/s, median of `iters`)."""
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    host.copy_(torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device="cuda"))
    dev = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    us = time_gpu_us(lambda: dev.copy_(host, non_blocking=True), iters=iters)
    return num_bytes / (us * 1e-6) / 1e9


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def kernel_times_us(fn: Callable[[], object], reset: Callable[[], object] | None = None, calls: int = 10,
                    name_filter: str = "") -> dict[str, float]:
    """Mean GPU time per call of each kernel whose name contains `name_filter` (torch profiler, CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            if reset is not None:
                reset()
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for evt in prof.key_averages():
        if name_filter in evt.key:
            total = getattr(evt, "device_time_total", None)
            if total is None:
                total = evt.cuda_time_total
            name = evt.key.replace("void ", "").replace("(anonymous namespace)::", "")
            out[name.split("(")[0]] = total / calls
    return out


def host_us_per_call(fn: Callable[[], object], calls: int = 200) -> float:
    """Host time to issue one call (launches are asynchronous: this is the CPU-side overhead)."""
    import time

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6
