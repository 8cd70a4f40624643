"""Benchmark of the CUDA swap-in (plan + copy kernels) on synthetic long-context workloads.

Each case: `batch` requests of `seq_len` tokens in the long path, device buffer D, top-k K, a controlled miss
rate (misses are tokens not held in the buffer; hits are held tokens; no ring hits). The tables are restored
before every timed call (untimed), so every call moves exactly miss_rate·K rows per request, and the calls
rotate over several independent workloads. Prints µs per call, GB/s over the missed rows, and the ratio to a
pinned host→device memcpy measured in the same run (one 256 MiB copy_, and one of the same bytes).

`--host-overhead` instead measures the host time to issue one hit-only call (no GPU time counted: 200 calls
are queued back to back) through the unbound extension function directly, the `kernels.swap_in` dispatcher with
and without its Python argument checks, the wrapper before checks were skipped, and the bound path that the
HiSparse backend calls (`kernels.BoundSwapIn`, tables bound once, checks on a shape's first call), next to the
call's GPU time. All columns come from one process, so before (unbound) and after (bound) compare directly.

`--copy-blocks N ...` instead sweeps the copy kernel's grid cap (HiSparseConfig side_stream_copy_blocks): the
swap-in alone and beside a weight-bound GEMM on another stream, as the early swap-in and GLM-5's prefetch run it.

    PYTHONPATH=$PWD python3 benchmarks/bench_swap_in.py [--quick] [--buffers D ...] [--batches B ...]
        [--miss-rates M ...] [--row-bytes N ...] [--host-overhead] [--copy-blocks N ...]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import device_name, host_us_per_call, kernel_times_us, pinned_h2d_gbps, time_gpu_us  # noqa: E402

from kernels.swap_in_cuda import swap_in_cuda  # noqa: E402
from kernels.swap_in_tables import SwapInTables  # noqa: E402

logger = logging.getLogger("bench_swap_in")
NUM_RECENT = 4
HOST_ROWS = 1 << 20


@dataclass
class Result:
    row_bytes: int
    buffer_size: int
    top_k: int
    batch: int
    miss_rate: float
    us_per_call: float
    missed_mb: float
    gbps: float
    memcpy_same_bytes_us: float
    ratio_to_memcpy: float


def random_pinned(rows: int, row_bytes: int) -> torch.Tensor:
    """Random bytes in pinned host memory (generated on the GPU, copied down: seconds faster than the CPU)."""
    host = torch.empty((rows, row_bytes), dtype=torch.uint8, pin_memory=True)
    chunk = 1 << 16
    for start in range(0, rows, chunk):
        part = torch.randint(0, 255, (min(chunk, rows - start), row_bytes), dtype=torch.uint8, device="cuda")
        host[start : start + part.shape[0]].copy_(part)
    torch.cuda.synchronize()
    return host


def make_workload(batch: int, buffer_size: int, top_k: int, miss_rate: float, seq_len: int):
    """Tables (held tokens, LRU order) and a top-k with exactly round(miss_rate·K) misses per request."""
    dev = "cuda"
    pool = seq_len - NUM_RECENT  # tokens outside the recent ring
    perm = torch.argsort(torch.rand(batch, pool, device=dev), dim=1).to(torch.int32)
    held = perm[:, :buffer_size]
    n_miss = round(miss_rate * top_k)
    n_hit = top_k - n_miss
    hit_pick = torch.argsort(torch.rand(batch, buffer_size, device=dev), dim=1)[:, :n_hit]
    hits = torch.gather(held, 1, hit_pick)
    misses = perm[:, buffer_size : buffer_size + n_miss]
    sel = torch.cat([hits, misses], dim=1)
    shuffle = torch.argsort(torch.rand(batch, top_k, device=dev), dim=1)
    topk = torch.gather(sel, 1, shuffle).contiguous()
    lru = torch.argsort(torch.rand(batch, buffer_size, device=dev), dim=1).to(torch.int32)
    return topk, held.contiguous(), lru, n_miss


def setup_case(host_pool: torch.Tensor, device_pool: torch.Tensor, batch: int, buffer_size: int, top_k: int,
               miss_rate: float, rotations: int = 4, max_copy_blocks: int = 0):
    """(call, reset, misses per request) of one case: `call()` swaps in the current workload, `reset()` (untimed)
    restores the tables and moves to the next of `rotations` workloads. The first call is checked to move exactly
    the planned hits and misses."""
    dev = "cuda"
    seq_len = 4 * buffer_size
    n_dev_rows = device_pool.shape[0]
    width = buffer_size + NUM_RECENT
    slots = torch.randperm(n_dev_rows, device=dev)[: batch * width].to(torch.int32).reshape(batch, width)
    host_rows = torch.randint(0, host_pool.shape[0], (batch, seq_len), dtype=torch.int32, device=dev)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int64, device=dev)
    req_rows = torch.arange(batch, dtype=torch.int64, device=dev)
    workloads = [make_workload(batch, buffer_size, top_k, miss_rate, seq_len) for _ in range(rotations)]
    live_tokens = torch.empty((batch, buffer_size), dtype=torch.int32, device=dev)
    live_lru = torch.empty_like(live_tokens)
    counters = torch.zeros(2, dtype=torch.int64, device=dev)
    tables = SwapInTables(slots, live_tokens, live_lru, host_rows, host_pool, device_pool, NUM_RECENT, counters)
    state = {"i": 0}

    def reset() -> None:
        state["i"] = (state["i"] + 1) % rotations
        _, tokens, lru, _ = workloads[state["i"]]
        live_tokens.copy_(tokens)
        live_lru.copy_(lru)

    def call() -> None:
        topk = workloads[state["i"]][0]
        swap_in_cuda(topk, seq_lens, req_rows, tables, max_copy_blocks=max_copy_blocks)

    reset()
    counters.zero_()
    call()
    torch.cuda.synchronize()
    n_miss = workloads[state["i"]][3]
    got = counters.tolist()
    if got != [batch * (top_k - n_miss), batch * n_miss]:
        raise RuntimeError(f"unexpected hit/miss counts {got} for {batch}x{top_k} at {miss_rate:.0%} misses")
    return call, reset, n_miss


def run_case(host_pool: torch.Tensor, device_pool: torch.Tensor, batch: int, buffer_size: int, top_k: int,
             miss_rate: float, peak_gbps: float, rotations: int = 4, breakdown: bool = False) -> Result:
    dev = "cuda"
    call, reset, n_miss = setup_case(host_pool, device_pool, batch, buffer_size, top_k, miss_rate, rotations)
    us = time_gpu_us(call, reset=reset)
    if breakdown:
        kernels = kernel_times_us(call, reset, name_filter="swap_in")
        host = host_us_per_call(call)
        logger.info("  kernels (B %d, D %d, %.0f%% misses; the copy kernel's time includes its PDL wait for the plan): "
                    "%s; host %.1f us per call", batch, buffer_size,
                    100 * miss_rate, ", ".join(f"{k} {v:.1f} us" for k, v in sorted(kernels.items())), host)
    row_bytes = host_pool.shape[1]
    missed = batch * n_miss * row_bytes
    gbps = missed / (us * 1e-6) / 1e9 if missed else 0.0
    memcpy_us = 0.0
    if missed:
        src = host_pool[: (missed + row_bytes - 1) // row_bytes].reshape(-1)[:missed]
        dst = torch.empty(missed, dtype=torch.uint8, device=dev)
        memcpy_us = time_gpu_us(lambda: dst.copy_(src, non_blocking=True), iters=10)
    return Result(row_bytes, buffer_size, top_k, batch, miss_rate, us, missed / 1e6, gbps, memcpy_us,
                  gbps / peak_gbps if missed else 0.0)


def copy_cap_sweep(caps: list[int], batches: list[int], miss_rates: list[float], row_bytes: int = 656,
                   buffer_size: int = 4096, top_k: int = 2048) -> list[dict]:
    """The copy kernel's grid cap (`max_copy_blocks`, 0 = the default two blocks an SM) against the swap-in's time
    alone and beside a weight-bound GEMM on another stream, as a side-stream swap-in runs (early swap-in, GLM-5
    prefetch): `together` is the fork (swap-in on a high-priority side stream) to the join. The GEMM, x [16, 7168]
    · W [7168, 4096] bf16 twice (~59 MB of weights a call), stands in for the projections an early swap-in runs
    beside. A cap that keeps `alone` and shortens `together` leaves the GEMM its SMs."""
    dev = "cuda"
    host_pool = random_pinned(HOST_ROWS, row_bytes)
    device_pool = torch.empty((max(batches) * (buffer_size + NUM_RECENT) + 64, row_bytes), dtype=torch.uint8,
                              device=dev)
    x = torch.randn(16, 7168, dtype=torch.bfloat16, device=dev)
    w = torch.randn(4096, 7168, dtype=torch.bfloat16, device=dev)
    y = torch.empty(16, 4096, dtype=torch.bfloat16, device=dev)

    def gemm() -> None:
        for _ in range(2):
            torch.mm(x, w.t(), out=y)

    gemm_us = time_gpu_us(gemm)
    side = torch.cuda.Stream(priority=-1)
    rows = []
    for batch in batches:
        for miss in miss_rates:
            for cap in caps:
                call, reset, n_miss = setup_case(host_pool, device_pool, batch, buffer_size, top_k, miss,
                                                 max_copy_blocks=cap)

                def together(call=call) -> None:
                    main = torch.cuda.current_stream()
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        call()
                    gemm()
                    main.wait_stream(side)

                alone = time_gpu_us(call, reset=reset)
                both = time_gpu_us(together, reset=reset)
                row = {"row_bytes": row_bytes, "batch": batch, "miss_rate": miss, "max_copy_blocks": cap,
                       "missed_mb": batch * n_miss * row_bytes / 1e6, "swap_alone_us": alone, "gemm_alone_us": gemm_us,
                       "together_us": both, "hidden_us": alone + gemm_us - both}
                rows.append(row)
                logger.info("cap %3d  B %3d  miss %3.0f%%: swap-in %7.1f us, GEMM %6.1f us, together %7.1f us",
                            cap, batch, 100 * miss, alone, gemm_us, both)
    return rows


def host_overhead(batches: list[int], buffer_size: int = 4096, top_k: int = 2048) -> list[dict]:
    """Host µs to issue one hit-only swap-in call, per entry point; GPU µs of the same call."""
    import kernels
    from kernels.cuda_ext import load_extension
    from kernels.swap_in_cuda import bind_swap_in_cuda

    dev = "cuda"
    ext = load_extension()
    host_pool = random_pinned(1 << 16, 1152)
    rows = []
    for batch in batches:
        seq_len = 4 * buffer_size
        width = buffer_size + NUM_RECENT
        device_pool = torch.empty((batch * width, 1152), dtype=torch.uint8, device=dev)
        slots = torch.arange(batch * width, device=dev, dtype=torch.int32).reshape(batch, width)
        host_rows = torch.randint(0, host_pool.shape[0], (batch, seq_len), dtype=torch.int32, device=dev)
        seq_lens = torch.full((batch,), seq_len, dtype=torch.int64, device=dev)
        req_rows = torch.arange(batch, dtype=torch.int64, device=dev)
        topk, tokens, lru, _ = make_workload(batch, buffer_size, top_k, 0.0, seq_len)
        counters = torch.zeros(2, dtype=torch.int64, device=dev)
        tables = SwapInTables(slots, tokens, lru, host_rows, host_pool, device_pool, NUM_RECENT, counters)
        batch_args = (topk, seq_lens, req_rows)
        ext_args = (*batch_args, *tables.extension_args())  # the extension's own argument list

        def previous(b=batch_args, t=tables, a=ext_args) -> None:  # the wrapper before checks could be skipped
            t.check(*b)
            if not t.host_pool.is_cuda and not t.host_pool.is_pinned():
                raise ValueError("host_pool must be pinned")
            ext.swap_in(*a)

        bound = kernels.BoundSwapIn(tables)
        context = bind_swap_in_cuda(tables)  # what BoundSwapIn calls once a shape is checked
        entry = {"extension": lambda a=ext_args: ext.swap_in(*a),
                 "kernels.swap_in, checked": lambda b=batch_args, t=tables: kernels.swap_in(*b, t),
                 "kernels.swap_in(check=False)": lambda b=batch_args, t=tables: kernels.swap_in(*b, t, check=False),
                 "previous wrapper": previous,
                 "BoundSwapIn (backend path)": lambda f=bound, t=topk, s=seq_lens, r=req_rows: f(t, s, r),
                 "SwapInContext alone": lambda f=context, t=topk, s=seq_lens, r=req_rows: f(t, s, r)}
        row = {"batch": batch, "gpu_us": time_gpu_us(entry["extension"])}
        for name, fn in entry.items():
            row[name] = min(host_us_per_call(fn) for _ in range(3))
        rows.append(row)
        logger.info("host overhead B %d: %s", batch, row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer cases (smoke run)")
    parser.add_argument("--json", type=Path, default=None, help="write all results here")
    parser.add_argument("--host-overhead", action="store_true", help="only the host cost per call (hit-only)")
    parser.add_argument("--copy-blocks", type=int, nargs="+", default=None, metavar="N",
                        help="only the copy-grid cap sweep: each cap N (0 = the default grid) alone and beside a "
                             "GEMM on another stream (FP8 rows, D 4096, batches 1 / 16 / 64, 5 / 20 %% misses)")
    parser.add_argument("--buffers", type=int, nargs="+", default=None, metavar="D",
                        help="device buffer sizes of the main grid (default 4096 8192; --quick 4096)")
    parser.add_argument("--batches", type=int, nargs="+", default=None, metavar="B",
                        help="batches of the main grid (default 1 16 64 128; --quick 1 64)")
    parser.add_argument("--miss-rates", type=float, nargs="+", default=[0.0, 0.05, 0.2, 0.5], metavar="M",
                        help="miss rates of the main grid")
    parser.add_argument("--row-bytes", type=int, nargs="+", default=[1152, 656], metavar="N",
                        help="row sizes of the main grid (1152: bf16 MLA row, 656: FP8 row)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    if args.copy_blocks:
        rows = copy_cap_sweep(args.copy_blocks, [1, 16, 64], [0.05, 0.2])
        if args.json:
            args.json.write_text(json.dumps({"device": device_name(), "copy_cap_sweep": rows}, indent=1))
        print(f"\ncopy-grid cap, FP8 rows, D 4096, K 2048, {device_name()}: swap-in alone / beside a GEMM "
              f"({rows[0]['gemm_alone_us']:.1f} us alone)")
        print("| batch | misses | cap | MB | alone us | together us | hidden us |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['batch']} | {r['miss_rate']:.0%} | {r['max_copy_blocks'] or 'default'} | "
                  f"{r['missed_mb']:.2f} | {r['swap_alone_us']:.1f} | {r['together_us']:.1f} | {r['hidden_us']:.1f} |")
        return
    if args.host_overhead:
        rows = host_overhead([1, 16, 64, 128])
        if args.json:
            args.json.write_text(json.dumps({"device": device_name(), "host_overhead": rows}, indent=1))
        names = [k for k in rows[0] if k not in ("batch", "gpu_us")]
        print(f"\nswap-in host µs per call (hit-only, D 4096, K 2048, bf16 rows), {device_name()}")
        print("| batch | GPU µs | " + " | ".join(names) + " |")
        print("|---|---|" + "---|" * len(names))
        for r in rows:
            print(f"| {r['batch']} | {r['gpu_us']:.1f} | " + " | ".join(f"{r[n]:.1f}" for n in names) + " |")
        worst = max(r["BoundSwapIn (backend path)"] for r in rows)
        print(f"\nbackend path (BoundSwapIn): at most {worst:.1f} µs per call over these batches (target <= 10 µs)")
        return
    top_k = 2048
    batches = args.batches or ([1, 16, 64, 128] if not args.quick else [1, 64])
    buffers = args.buffers or ([4096, 8192] if not args.quick else [4096])
    miss_rates = args.miss_rates
    row_sizes = args.row_bytes
    peak = pinned_h2d_gbps(256 << 20)
    logger.info("device: %s; pinned H2D memcpy, 256 MiB: %.1f GB/s", device_name(), peak)
    results: list[Result] = []
    for row_bytes in row_sizes:
        host_pool = random_pinned(HOST_ROWS, row_bytes)
        device_pool = torch.empty((max(batches) * (max(buffers) + NUM_RECENT) + 64, row_bytes), dtype=torch.uint8,
                                  device="cuda")
        for buffer_size in buffers:
            for batch in batches:
                for miss in miss_rates:
                    r = run_case(host_pool, device_pool, batch, buffer_size, top_k, miss, peak,
                                 breakdown=batch == 64 and miss in (0.0, 0.2))
                    results.append(r)
                    logger.info("row %4d B  D %5d  B %3d  miss %4.0f%%: %9.1f us  %8.2f MB  %6.1f GB/s  (memcpy same "
                                "bytes %8.1f us)  %.2fx memcpy", r.row_bytes, r.buffer_size, r.batch, 100 * r.miss_rate,
                                r.us_per_call, r.missed_mb, r.gbps, r.memcpy_same_bytes_us, r.ratio_to_memcpy)
        del host_pool, device_pool
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"device": device_name(), "memcpy_gbps": peak,
                                         "results": [asdict(r) for r in results]}, indent=1))
    print(f"\nswap-in, K={top_k}, {device_name()}, pinned H2D memcpy {peak:.1f} GB/s")
    print("| row B | D | batch | miss | us/call | GB/s | x memcpy |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r.row_bytes} | {r.buffer_size} | {r.batch} | {r.miss_rate:.0%} | {r.us_per_call:.1f} | "
              f"{r.gbps:.1f} | {r.ratio_to_memcpy:.2f} |")


if __name__ == "__main__":
    main()
