"""Interference v2 (issue 23 item 3): does the main stream lose its kernels' time to SMs held by long-lived copy
blocks (capped grid) — and do short-lived copy blocks (each copies a chunk of misses and exits) on a side stream of
lower priority than the main stream's give those SMs back? Run on a tree with bench_tmp/chunked.patch applied
(max_copy_blocks < 0: chunks of -max_copy_blocks misses, one block each, no PDL)."""
# ruff: noqa: B023, E402, I001
import statistics
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_sparse_mla import SCALE
from bench_swap_in import HOST_ROWS, NUM_RECENT, random_pinned, setup_case
from kernels.sparse_mla_gluon import sparse_mla_decode_gluon
from kernels.fp8_rows import pack_fp8_rows

try:
    from kernels.sparse_mla_flashmla import sparse_mla_decode_flashmla
except ImportError:
    sparse_mla_decode_flashmla = None


def measure(fn, occ, reset, main, side, iters=15):
    """(main µs, occupier µs) medians: occupier launched on `side`, 10 µs later fn on `main`."""
    mt, ot = [], []
    for i in range(iters + 3):
        if reset is not None:
            reset()
        torch.cuda.synchronize()
        s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        o0, o1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(main):
            torch.cuda._sleep(3_000_000)  # ~1.5 ms: the host enqueues everything below while it runs
            if occ is not None:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    o0.record()
                    occ()
                    o1.record()
                torch.cuda._sleep(20_000)
            s0.record()
            if fn is not None:
                fn()
            s1.record()
        torch.cuda.synchronize()
        if i >= 3:
            mt.append(s0.elapsed_time(s1) * 1e3)
            if occ is not None:
                ot.append(o0.elapsed_time(o1) * 1e3)
    return statistics.median(mt), (statistics.median(ot) if ot else float("nan"))


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    print(torch.cuda.get_device_name(), flush=True)
    host_pool = random_pinned(HOST_ROWS, 656)
    batch, buffer_size, top_k = 64, 4096, 2048
    device_pool = torch.empty((batch * (buffer_size + NUM_RECENT) + 64, 656), dtype=torch.uint8, device=dev)
    caps = {"capped-16": 16, "capped-32": 32, "chunk-64": -64, "chunk-128": -128, "chunk-512": -512,
            "full": 0}
    swaps = {name: setup_case(host_pool, device_pool, batch, buffer_size, top_k, 0.2, max_copy_blocks=cap)
             for name, cap in caps.items()}
    pool = pack_fp8_rows(torch.randn(1 << 18, 576, device=dev))
    q = torch.randn(64, 64, 576, device=dev).bfloat16()
    idx = torch.randint(0, pool.shape[0], (64, 2048), device=dev, dtype=torch.int32)
    x = torch.randn(64, 7168, dtype=torch.bfloat16, device=dev)
    w = torch.randn(4096, 7168, dtype=torch.bfloat16, device=dev)
    xs = torch.randn(64, 2048, dtype=torch.bfloat16, device=dev)
    ws = torch.randn(7168, 2048, dtype=torch.bfloat16, device=dev)
    kernels = {"attn Gluon FP8 H64 B64": lambda: sparse_mla_decode_gluon(q, pool, idx, SCALE),
               "attn Gluon 1 split": lambda: sparse_mla_decode_gluon(q, pool, idx, SCALE, splits=1),
               "GEMM 64x7168x4096": lambda: torch.mm(x, w.t())}
    if sparse_mla_decode_flashmla is not None:
        kernels["FlashMLA FP8 H64 B64"] = lambda: sparse_mla_decode_flashmla(q, pool, idx, SCALE)

    def sequence():  # ~a layer's worth of main-stream kernels
        for _ in range(2):
            torch.mm(x, w.t())
            sparse_mla_decode_gluon(q, pool, idx, SCALE)
            torch.mm(xs, ws.t())
            if sparse_mla_decode_flashmla is not None:
                sparse_mla_decode_flashmla(q, pool, idx, SCALE)
            for _ in range(8):
                torch.mm(xs[:, :512], ws[:512, :512].t())
    kernels["sequence"] = sequence
    for pm, ps in ((0, 0), (-1, 0), (0, -1)):
        main_s = torch.cuda.Stream(priority=pm)
        side_s = torch.cuda.Stream(priority=ps)
        print(f"\n## main priority {pm}, side priority {ps}", flush=True)
        alone = {name: measure(fn, None, None, main_s, side_s)[0] for name, fn in kernels.items()}
        occ_alone = {name: measure(None, call, reset, main_s, side_s)[1] for name, (call, reset, _) in swaps.items()}
        print("| occupier | copy alone µs | " + " | ".join(f"{k} (alone {v:.0f})" for k, v in alone.items()) + " |")
        for name, (call, reset, _) in swaps.items():
            cells = []
            for kname, fn in kernels.items():
                m, o = measure(fn, call, reset, main_s, side_s)
                cells.append(f"{m / alone[kname]:.2f}× / copy {o:.0f}")
            print(f"| {name} | {occ_alone[name]:.0f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
