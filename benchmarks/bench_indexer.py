"""Benchmark of the lightning indexer on the GPU: scores kernels against the HBM bandwidth measured in the same run,
the top-k kernel against torch.topk, and the whole call, new path against the previous one (same run, same inputs).

- HBM bandwidth: one device-to-device `copy_` of a 2 GiB buffer, (read + write bytes) / time.
- Scores (`scores` table): 64 indexer heads × 128, one decode query per request seeing its whole context L,
  B ∈ {1, 16, 64}, L ∈ {8K, 32K, 64K, 128K}. Keys in the engine's paged layout: each request's positions map
  through token_rows to random pages of 64 consecutive rows of one shared FP8 pool (`--layout rows`: every
  position a random row). Kernels: "previous" (kernels/indexer_triton.py: q as fp16 hi + lo, synchronous scale
  gathers) and the new kernel (kernels/indexer_fast.py) in each precision (fp8 = the engine's default since
  2026-11-26, fp16, fp16x2), and "fast e4m3 q": the fp8 kernel given the query already in e4m3 (`quantize_query`,
  the form the model hands it on CUDA since 2026-11-27; same score bits as "fast fp8"); the query's quantization
  itself is timed apart (`quantize_us` in the JSON's `query_quant`; in the engine it replaces the multiply by
  the weight scale). `chains` table: the indexer's query chain from wq_b's output to the scores, and its key
  chain, each replayed as one CUDA graph, as the engine ran them (cast, rotary kernel, Hadamard GEMM, then the
  scale and the float query's scores, or the e4m3 query's) and as one kernel each
  (kernels/indexer_rotation_triton.py). Bytes = B·L·(128 key + 4 scale + 4 row id + 4 score written); GB/s = bytes / time; `hbm_fraction` =
  GB/s / the copy's GB/s. score err = max |score − fp64| / max |fp64| over the first 4 queries. Each case also
  times a plain read of the same bytes ("read of the same bytes": a streaming Triton read of B·L·140 bytes, 4
  programs an SM, 32 KB loads): what the size alone allows, launch, first DRAM round trips and tail included (at
  B 16, 32K: 85 % of the copy's rate on an H200, 87–88 % on an H100 by events, 2026-11-27; `torch.sum`, the read used
  here before, reaches 70 / 77 %); `read_fraction` = that read's time / the kernel's.
- In a replayed graph (`graph_us`, `graph_hbm_fraction`; the read, "fast fp8" and "fast e4m3 q"): what one call
  adds to a CUDA graph of L2 flushes (16 flush + call pairs against 16 flushes, medians of 15 replays each): the
  call's cost where the engine runs it, in the decode step's graphs. Events around one call also time the
  front end's work on the events themselves; `event_floor_us` = a one-element fill timed that way.
  "e4m3 q after the key write": the engine's order since 2026-11-28 — the layer's index-key write
  (`write_index_rows`, B new keys) and then the scores with `tables_ready` (started early by programmatic
  dependent launch on Hopper): what the scores add to 16 × (flush, write) in a graph. `index_writes`: the write
  itself in the graph, one kernel against the two indexed assignments it replaced.
- Mixed lengths (`mixed` table): decode batches hold requests of different lengths. Per shape (B, L), the
  lengths equal (all L) and mixed (uniform in [L/8, L], seeded): the scores of the e4m3 query after the key
  write, in a replayed graph, by the per-query kernel (`FastScoresConfig(balanced=False)`: spans sized for the
  longest row) and the balanced kernel (the default: the batch's blocks split evenly over one wave), fraction of
  the copy over the bytes of the positions the batch has (sum of lengths × 140 B), and whether both gave the same
  scores at every visible position.
- Top-k (`topk` table): the engine's CUDA kernel (kernels/topk_cuda.py) and the Triton kernel
  (kernels/topk_triton.py, its fallback for very wide rows) against torch.topk (sorted, as the previous path ran
  it, and unsorted) on the same fp32 scores, B ∈ {1, 16, 64, 128}, L ∈ {32K, 64K, 128K}: random normal scores,
  and the indexer's own scores at the scores cases; `fast` = fraction of rows that took the fast path.
- Whole call (`calls` table): `indexer_topk_fast` (the engine's path) against `indexer_topk_triton` (the previous
  path: previous scores kernel + torch.topk), with the overlap of their selected sets (mean/min over queries).
- `--configs`: the new scores kernel's launch shapes at B 64, L 32K (precision × BLOCK_N × warps × stages ×
  blocks per program).
- `--smoke`: a CPU check of this script (Triton's interpreter, tiny shapes, wall-clock times: meaningless numbers);
  tests/kernels/test_triton_cpu.py runs it.
Timing: CUDA events around each call, the host enqueueing behind a GPU spin, median of 20 after 3 warm-ups, the L2
flushed (untimed) before every call (so the top-k reads its scores from HBM). The flush reads a 256 MiB buffer
(`--flush read`, the default since 2026-11-26): the L2 is left holding clean lines, as after the decode step's
projections. `--flush write` zeroes it instead (the runs before): the L2 is then left holding ~50 MB of dirty
lines, whose write-back the timed kernel paid for (~12-15 us at H100 speed, most of a 32K batch-16 call). Every case is guarded: a failure is
logged and recorded, the rest still run; the JSON is rewritten after every case.

    PYTHONPATH=$PWD python3 benchmarks/bench_indexer.py [--configs] [--layout paged|rows] [--json out.json]
    PYTHONPATH=$PWD python3 benchmarks/bench_indexer.py --smoke
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
SMOKE = "--smoke" in sys.argv
if SMOKE:  # before triton is imported
    from kernels import triton_interpret

    triton_interpret.enable()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from _timing import device_name, time_gpu_us  # noqa: E402

from kernels.indexer_fast import (  # noqa: E402
    FastScoresConfig,
    indexer_scores_fast,
    indexer_topk_fast,
    quantize_query,
    write_index_rows,
)
from kernels.indexer_ref import quantize_index_keys  # noqa: E402
from kernels.indexer_triton import ScoresConfig, indexer_scores_triton, indexer_topk_triton  # noqa: E402
from kernels.topk_cuda import topk_positions_cuda  # noqa: E402
from kernels.topk_triton import topk_positions_triton  # noqa: E402

logger = logging.getLogger("bench_indexer")
HEADS = 64
TOP_K = 2048
PAGE = 64
SCORE_BATCHES = (1, 16, 64)
SCORE_LENGTHS = (8192, 32768, 65536, 131072)
TOPK_BATCHES = (1, 16, 64, 128)
TOPK_LENGTHS = (32768, 65536, 131072)
PRECISIONS = ("fp16", "fp16x2", "fp8")
BYTES_PER_POSITION = 128 + 4 + 4 + 4  # key row, scale, row id, score written
COPY_BYTES = 2 << 30
SWEEP_SHAPE = (64, 32768)  # (B, L) of --configs
MIXED_SHAPES = ((16, 32768), (64, 32768), (64, 131072), (128, 65536))  # (B, L) of the `mixed` table
PER_QUERY = FastScoresConfig(balanced=False)  # the scores kernel with spans per query (the default until 2026-11-28)
READ_FLOOR = "read of the same bytes"  # `_stream_read_kernel` over B·L·BYTES_PER_POSITION bytes: the size's floor
READ_PROGRAMS_PER_SM = 4  # the streaming read's launch: the fastest of 1–16 programs an SM × 8–32 KB loads, 2026-11-27
READ_BLOCK = 8192  # int32 words a program loads at once (32 KB)
E4M3_Q = "fast e4m3 q"  # the fp8 kernel on a query quantized beforehand (the engine's path on CUDA)
AFTER_WRITE = "e4m3 q after the key write"  # the engine's order: index-key write, scores started early
GRAPH_TIMED = (READ_FLOOR, "fast fp8", E4M3_Q, AFTER_WRITE)  # also timed in a replayed graph (`Bench.graph_us`)
GRAPH_PAIRS = 16  # (flush, call) pairs in one graph
GRAPH_REPLAYS = 15
DEVICE = "cuda"
if SMOKE:
    SCORE_BATCHES, SCORE_LENGTHS, TOPK_BATCHES, TOPK_LENGTHS = (1,), (4096,), (2,), (4096, 12288)
    COPY_BYTES, DEVICE, SWEEP_SHAPE, MIXED_SHAPES = 64 << 20, "cpu", (1, 4096), ((3, 4096),)


@triton.jit
def _stream_read_kernel(words_ptr, out_ptr, num_words, words_per_program, BLOCK: tl.constexpr):
    """A plain read: each program sums its contiguous share of the buffer in BLOCK-word loads (L2-bypassing), so
    that the only work is the read itself; the sum is stored so that the loads are not optimized away."""
    start = tl.program_id(0) * words_per_program
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for offset in range(start, start + words_per_program, BLOCK):
        offs = offset + tl.arange(0, BLOCK)
        acc += tl.load(words_ptr + offs, mask=offs < num_words, other=0, cache_modifier=".cg")
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def _wall_us(fn: Callable[[], object], reset: Callable[[], object] | None = None, **_: object) -> float:
    """--smoke timing on the CPU: one wall-clock call (the numbers only show the script runs)."""
    if reset is not None:
        reset()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


if SMOKE:
    time_gpu_us = _wall_us  # noqa: F811
# The previous kernel sizes its grid from the SM count (a CUDA query); the interpreter gets a fixed span.
PREVIOUS = ScoresConfig(blocks_per_program=4) if SMOKE else None


@dataclass
class ScoresResult:
    batch: int
    length: int
    kernel: str
    us: float
    gbps: float
    hbm_fraction: float
    tflops: float
    score_err: float
    read_fraction: float = float("nan")  # a plain read of the same bytes (READ_FLOOR) / this kernel: time ratio
    # In a replayed CUDA graph, as the decode step runs it: the time this call adds to a graph of L2 flushes
    # (`Bench.graph_us`); nan where not measured (only the read, fast fp8 and the e4m3 query's kernel are).
    graph_us: float = float("nan")
    graph_hbm_fraction: float = float("nan")


@dataclass
class TopkResult:
    batch: int
    length: int
    source: str
    torch_sorted_us: float
    torch_unsorted_us: float
    kernel_us: float  # the engine's kernel: CUDA (kernels/topk_cuda.py); under --smoke the Triton one
    speedup_vs_sorted: float
    speedup_vs_unsorted: float
    fast_path_fraction: float  # of the Triton kernel's rows
    triton_us: float  # the Triton kernel (kernels/topk_triton.py: the fallback for rows beyond the CUDA one's width)
    same: bool  # both kernels gave the same positions


@dataclass
class QueryQuantResult:
    batch: int
    quantize_us: float  # quantize_query on [B, 64, 128]: one launch per layer and step in the engine
    multiply_us: float  # what it replaces: weights * weight_scale


@dataclass
class ChainResult:
    batch: int
    length: int
    float_q_us: float  # cast, rotary, Hadamard GEMM, weights * weight_scale, fp8 scores on the float query
    e4m3_q_us: float  # cast, rotary, Hadamard GEMM, quantize_query, scores on the e4m3 query
    one_kernel_q_us: float  # the query chain as one kernel (indexer_rotation_triton.index_query), scores
    keys_separate_us: float  # the keys: rotary, Hadamard GEMM, packing (three launches + the cast)
    keys_one_kernel_us: float  # the keys as one kernel (indexer_rotation_triton.index_keys)


@dataclass
class WriteResult:
    batch: int
    indexed_us: float  # keys[rows] = new keys; scales[rows] = new scales (the engine's write until 2026-11-28)
    kernel_us: float  # write_index_rows: one kernel (in a replayed graph, what each adds to 16 L2 flushes)


@dataclass
class MixedResult:
    batch: int
    length: int  # the longest length; mixed: lengths uniform in [length / 8, length]
    lengths: str  # "equal" or "mixed"
    positions: int  # sum of the batch's lengths
    per_query_us: float  # in a replayed graph after the key write, early-started: FastScoresConfig(balanced=False)
    balanced_us: float  # the same with the default config (the balanced split)
    per_query_fraction: float  # positions × BYTES_PER_POSITION / time, as a fraction of the copy's rate
    balanced_fraction: float
    same: bool  # both kernels' scores equal at every visible position


@dataclass
class CallResult:
    batch: int
    length: int
    previous_us: float
    new_us: float
    speedup: float
    overlap_mean: float
    overlap_min: float


@dataclass
class Report:
    device: str
    layout: str
    flush: str
    command: str
    date: str
    hbm_copy_gbps: float = 0.0
    event_floor_us: float = 0.0  # an empty-ish kernel (a one-element fill) timed like the kernels: events' own cost
    scores: list[ScoresResult] = field(default_factory=list)
    topk: list[TopkResult] = field(default_factory=list)
    calls: list[CallResult] = field(default_factory=list)
    mixed: list[MixedResult] = field(default_factory=list)
    query_quant: list[QueryQuantResult] = field(default_factory=list)
    chains: list[ChainResult] = field(default_factory=list)
    index_writes: list[WriteResult] = field(default_factory=list)
    configs: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def hbm_copy_gbps(num_bytes: int = COPY_BYTES) -> float:
    """Device-to-device copy bandwidth, read + write bytes counted (median of 10)."""
    src = torch.ones(num_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    us = time_gpu_us(lambda: dst.copy_(src), iters=10)
    return 2 * num_bytes / (us * 1e-6) / 1e9


def make_pool(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.empty((rows, 128), dtype=torch.float8_e4m3fn, device=DEVICE)
    scales = torch.empty(rows, dtype=torch.float32, device=DEVICE)
    step = 1 << 20
    for start in range(0, rows, step):
        end = min(rows, start + step)
        keys[start:end], scales[start:end] = quantize_index_keys(torch.randn(end - start, 128, device=DEVICE))
    return keys, scales


def token_table(batch: int, length: int, layout: str, pool_rows: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, length] int32 rows: random pages of PAGE consecutive rows (the engine's allocator), or random rows."""
    if layout == "paged":
        pages = torch.randperm(pool_rows // PAGE, device=DEVICE, generator=gen)[: batch * length // PAGE]
        rows = pages.unsqueeze(1) * PAGE + torch.arange(PAGE, device=DEVICE)
    else:
        rows = torch.randperm(pool_rows, device=DEVICE, generator=gen)[: batch * length]
    return rows.to(torch.int32).reshape(batch, length)


def score_error(scores: torch.Tensor, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor,
                token_rows: torch.Tensor, queries: int = 4) -> float:
    worst = 0.0
    for t in range(min(queries, scores.shape[0])):
        rows = token_rows[t].long()
        exact = torch.einsum("hd,nd->hn", q[t].double(), keys[rows].double()).relu()
        exact = (w[t].double() @ exact) * scales[rows].double()
        worst = max(worst, float((scores[t].double() - exact).abs().max() / exact.abs().max()))
    return worst


def overlap(a: torch.Tensor, b: torch.Tensor, length: int) -> tuple[float, float]:
    """Mean and min over queries of |set(a) ∩ set(b)| / top_k."""
    ma = torch.zeros((a.shape[0], length), dtype=torch.bool, device=a.device)
    mb = torch.zeros_like(ma)
    ma.scatter_(1, a.long(), True)
    mb.scatter_(1, b.long(), True)
    frac = (ma & mb).sum(dim=1).float() / TOP_K
    return float(frac.mean()), float(frac.min())


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.report = Report(device=device_name(), layout=args.layout, flush=args.flush, command=" ".join(sys.argv),
                             date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        self.flush = torch.zeros(1 << 20 if SMOKE else 256 << 20, dtype=torch.uint8, device=DEVICE)
        self.flush_words = self.flush.view(torch.int64)
        self.flush_sink = torch.zeros((), dtype=torch.int64, device=DEVICE)
        self.pool_rows = max([max(SCORE_BATCHES) * max(SCORE_LENGTHS)] + [b * n for b, n in MIXED_SHAPES])
        self.keys, self.scales = make_pool(self.pool_rows)

    def save(self) -> None:
        if self.args.json:
            self.args.json.write_text(json.dumps(asdict(self.report), indent=1))

    def guarded(self, what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # one case failing must not lose the others
            logger.exception("%s failed", what)
            self.report.errors.append(f"{what}: {exc!r}"[:500])
        torch.cuda.empty_cache()
        self.save()

    def evict_l2(self) -> None:
        """The untimed L2 eviction before each call (`--flush`)."""
        if self.args.flush == "write":
            self.flush.zero_()
        else:
            self.flush_read()

    def time(self, fn: Callable[[], object]) -> float:
        return time_gpu_us(fn, reset=self.evict_l2)

    def graph_us(self, fn: Callable[[], object], before: Callable[[], object] | None = None) -> float:
        """What one call adds to a replayed CUDA graph: GRAPH_PAIRS × (L2 eviction, [before,] fn) against
        GRAPH_PAIRS × (L2 eviction[, before]), each graph replayed GRAPH_REPLAYS times (interleaved), the medians'
        difference / GRAPH_PAIRS. This is the call's cost in the decode step's graphs (launch, DRAM ramp and tail
        included; no event or host cost), where `time` brackets one call with events. `before`: the kernel the
        engine runs right before the call. Wall time of one call under --smoke."""
        if SMOKE:
            return self.time(fn)
        if before is not None:
            before()
        fn()
        torch.cuda.synchronize()
        graphs = []
        for with_fn in (True, False):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(GRAPH_PAIRS):
                    self.evict_l2()
                    if before is not None:
                        before()
                    if with_fn:
                        fn()
            graph.replay()
            graphs.append(graph)
        torch.cuda.synchronize()
        times: list[list[float]] = [[], []]
        for _ in range(GRAPH_REPLAYS):
            for graph, out in zip(graphs, times, strict=True):
                torch.cuda._sleep(1_000_000)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end) * 1000.0)
        del graphs
        return (statistics.median(times[0]) - statistics.median(times[1])) / GRAPH_PAIRS

    def read_us(self, num_bytes: int) -> tuple[float, float]:
        """Time of one plain read of num_bytes, timed like the kernels: events, and in a graph. The read is
        `_stream_read_kernel` on READ_PROGRAMS_PER_SM programs an SM: at B 16, 32K (73 MB) it reaches 85–88 % of
        the copy's rate by events where `torch.sum` (this floor until 2026-11-27) reaches 70–77 %
        (benchmarks/results/indexer_in_graph_2026-11-27/read_floor.py)."""
        words = torch.ones(num_bytes // 4, dtype=torch.int32, device=DEVICE)
        sms = 1 if SMOKE else torch.cuda.get_device_properties(words.device).multi_processor_count
        per_program = triton.cdiv(triton.cdiv(words.numel(), READ_PROGRAMS_PER_SM * sms), READ_BLOCK) * READ_BLOCK
        programs = triton.cdiv(words.numel(), per_program)
        sums = torch.empty(programs, dtype=torch.int32, device=DEVICE)

        def read() -> None:
            _stream_read_kernel[(programs,)](words, sums, words.numel(), per_program, BLOCK=READ_BLOCK,
                                             num_warps=8)

        read()
        if int(sums.sum()) != words.numel():
            raise RuntimeError("the streaming read did not read every word once")
        return self.time(read), self.graph_us(read)

    def fraction(self, num_bytes: int, us: float) -> float:
        """num_bytes moved in `us`, as a fraction of the copy's rate."""
        return num_bytes / (us * 1e-6) / 1e9 / self.report.hbm_copy_gbps

    def flush_read(self) -> None:
        """Evict the L2 by reading a buffer larger than it (leaves clean lines: nothing to write back)."""
        torch.sum(self.flush_words, dim=0, out=self.flush_sink)

    def inputs(self, batch: int, length: int, seed: int):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        token_rows = token_table(batch, length, self.args.layout, self.pool_rows, gen)
        q = torch.randn(batch, HEADS, 128, device=DEVICE, generator=gen)
        w = torch.randn(batch, HEADS, device=DEVICE, generator=gen) * HEADS**-0.5
        seq = torch.full((batch,), length, device=DEVICE, dtype=torch.int64)
        return (q, w, self.keys, self.scales, token_rows, torch.arange(batch, device=DEVICE), seq)

    def scores_case(self, batch: int, length: int) -> None:
        args = self.inputs(batch, length, batch * 7 + length)
        q, w, keys, scales, token_rows, _, seq = args
        position_bytes = batch * length * BYTES_PER_POSITION
        flops = 2.0 * batch * length * HEADS * 128
        # The floor at this size: one plain read of the same bytes (launch, first DRAM round trips and tail
        # included), which a small call cannot beat however its loads are scheduled.
        read_us, read_graph_us = self.read_us(position_bytes)
        read_gbps = position_bytes / (read_us * 1e-6) / 1e9
        floor = ScoresResult(batch, length, READ_FLOOR, read_us, read_gbps, self.fraction(position_bytes, read_us),
                             0.0, float("nan"), 1.0, read_graph_us, self.fraction(position_bytes, read_graph_us))
        logger.info("%s", floor)
        self.report.scores.append(floor)
        kernels: list[tuple[str, Callable[[], torch.Tensor]]] = [
            ("previous fp16x2", lambda: indexer_scores_triton(*args, PREVIOUS))]
        kernels += [(f"fast {p}", lambda p=p: indexer_scores_fast(*args, FastScoresConfig(precision=p)))
                    for p in PRECISIONS]
        q8, w8 = quantize_query(q, w)
        kernels.append((E4M3_Q, lambda: indexer_scores_fast(q8, w8, *args[2:], FastScoresConfig(precision="fp8"))))
        kernels.append((AFTER_WRITE, lambda: indexer_scores_fast(q8, w8, *args[2:], FastScoresConfig(precision="fp8"),
                                                                 tables_ready=True)))
        write = self.key_write(args, batch)
        if not any(r.batch == batch for r in self.report.query_quant):
            quant = QueryQuantResult(batch, self.time(lambda: quantize_query(q, w, 0.1)), self.time(lambda: w * 0.1))
            logger.info("%s", quant)
            self.report.query_quant.append(quant)
        for name, fn in kernels:
            scores = fn()
            us = self.time(fn)
            gbps = position_bytes / (us * 1e-6) / 1e9
            graph_us = (self.graph_us(fn, before=write if name == AFTER_WRITE else None) if name in GRAPH_TIMED
                        else float("nan"))
            res = ScoresResult(batch, length, name, us, gbps, self.fraction(position_bytes, us),
                               flops / (us * 1e-6) / 1e12, score_error(scores, q, w, keys, scales, token_rows),
                               read_us / us, graph_us, self.fraction(position_bytes, graph_us))
            logger.info("%s", res)
            self.report.scores.append(res)
        self.chain_case(batch, length, args)
        scores = indexer_scores_fast(*args)
        if length >= TOPK_LENGTHS[0]:
            self.topk_timing(batch, length, "indexer scores", scores, seq)
        new = indexer_topk_fast(*args, TOP_K)
        new_us = self.time(lambda: indexer_topk_fast(*args, TOP_K))
        old = indexer_topk_triton(*args, TOP_K, PREVIOUS)
        old_us = self.time(lambda: indexer_topk_triton(*args, TOP_K, PREVIOUS))
        mean, low = overlap(new, old, length)
        call = CallResult(batch, length, old_us, new_us, old_us / new_us, mean, low)
        logger.info("%s", call)
        self.report.calls.append(call)

    def mixed_case(self, batch: int, length: int, lengths: str) -> None:
        """Per-query against balanced scores kernel on one batch of equal or mixed lengths (`mixed` table)."""
        q, w, keys, scales, token_rows, req, seq = self.inputs(batch, length, batch * 7 + length)
        if lengths == "mixed":
            gen = torch.Generator(device=DEVICE).manual_seed(batch + length)
            seq = torch.randint(length // 8, length + 1, (batch,), device=DEVICE, generator=gen)
        args = (q, w, keys, scales, token_rows, req, seq)
        write = self.key_write(args, batch)
        q8, w8 = quantize_query(q, w)
        timed = {}
        for name, cfg in (("per_query", PER_QUERY), ("balanced", FastScoresConfig())):
            def call(cfg: FastScoresConfig = cfg) -> torch.Tensor:
                return indexer_scores_fast(q8, w8, keys, scales, token_rows, req, seq, cfg, tables_ready=True)

            timed[name] = (call(), self.graph_us(call, before=write))
        positions = int(seq.sum())
        same = all(torch.equal(timed["balanced"][0][t, :n], timed["per_query"][0][t, :n])
                   for t, n in enumerate(seq.tolist()))
        nbytes = positions * BYTES_PER_POSITION
        res = MixedResult(batch, length, lengths, positions, timed["per_query"][1], timed["balanced"][1],
                          self.fraction(nbytes, timed["per_query"][1]), self.fraction(nbytes, timed["balanced"][1]),
                          same)
        logger.info("%s", res)
        self.report.mixed.append(res)

    def key_write(self, args: tuple, batch: int) -> Callable[[], None]:
        """The layer's index-key write as the engine runs it before the scores (B new keys at each request's last
        position, here their own bytes again); times it once a batch size against the indexed assignments."""
        _, _, keys, scales, token_rows, req, seq = args
        rows = token_rows[req, seq - 1].long()
        new_keys, new_scales = keys[rows].clone(), scales[rows].clone()

        def write() -> None:
            write_index_rows(keys, scales, rows, new_keys, new_scales)

        def indexed() -> None:
            keys[rows] = new_keys
            scales[rows] = new_scales

        if not any(r.batch == batch for r in self.report.index_writes):
            res = WriteResult(batch, self.graph_us(indexed), self.graph_us(write))
            logger.info("%s", res)
            self.report.index_writes.append(res)
        return write

    def chain_case(self, batch: int, length: int, args: tuple) -> None:
        """The indexer's query chain and the scores kernel, and its key chain, as the engine has run them, each
        captured as one CUDA graph (eager under --smoke): wq_b's bf16 output → cast, rotary kernel, the Hadamard
        GEMM, then `w * scale` and scores of the float query (before 2026-11-27) or `quantize_query` and scores of
        the e4m3 query; or the one-kernel chain (kernels/indexer_rotation_triton.py) and scores. Keys: rotary
        kernel, GEMM, packing kernel against the one-kernel chain."""
        from kernels import fp8_quant_triton, indexer_rotation_triton, norm_rope_triton
        from kernels.indexer_ref import walsh_hadamard

        q, w, *rest = args
        gen = torch.Generator(device=DEVICE).manual_seed(batch)
        q_raw = q.to(torch.bfloat16)
        k_in = torch.randn(batch, 128, device=DEVICE, generator=gen)
        angles = torch.rand(batch, 32, device=DEVICE, generator=gen) * 1000
        cos, sin = torch.cos(angles), torch.sin(angles)
        hadamard = walsh_hadamard(torch.eye(128, device=DEVICE))
        fp8 = FastScoresConfig(precision="fp8")

        def rotated(x: torch.Tensor) -> torch.Tensor:
            x = x.to(torch.float32, copy=True)  # the engine's cast (a copy even of float32 input)
            norm_rope_triton.rope(x[..., :64], cos, sin, False, out=x[..., :64])
            return (x.reshape(-1, 128) @ hadamard).view(x.shape)

        def float_q() -> torch.Tensor:
            return indexer_scores_fast(rotated(q_raw), w * 0.1, *rest, fp8)

        def e4m3_q() -> torch.Tensor:
            return indexer_scores_fast(*quantize_query(rotated(q_raw), w, 0.1), *rest, fp8)

        def one_kernel_q() -> torch.Tensor:
            q8, w8 = indexer_rotation_triton.index_query(q_raw, cos, sin, False, w, 0.1, quantize=True)
            return indexer_scores_fast(q8, w8, *rest, fp8)

        def keys_separate() -> tuple[torch.Tensor, torch.Tensor]:
            return fp8_quant_triton.quantize_index_keys(rotated(k_in))

        def keys_one_kernel() -> tuple[torch.Tensor, torch.Tensor]:
            return indexer_rotation_triton.index_keys(k_in, cos, sin, False)

        timed = []
        for fn in (float_q, e4m3_q, one_kernel_q, keys_separate, keys_one_kernel):
            fn()  # compile outside a capture
            if SMOKE:
                timed.append(self.time(fn))
                continue
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            graph.replay()
            timed.append(self.time(graph.replay))
        chain = ChainResult(batch, length, *timed)
        logger.info("%s", chain)
        self.report.chains.append(chain)

    def topk_timing(self, batch: int, length: int, source: str, scores: torch.Tensor, seq: torch.Tensor) -> None:
        picked, paths = topk_positions_triton(scores, seq, TOP_K, return_paths=True)
        triton_us = self.time(lambda: topk_positions_triton(scores, seq, TOP_K))
        engine = topk_positions_triton if SMOKE else topk_positions_cuda
        same = bool(torch.equal(engine(scores, seq, TOP_K), picked))
        kernel_us = self.time(lambda: engine(scores, seq, TOP_K))
        sorted_us = self.time(lambda: torch.topk(scores, TOP_K, dim=1, sorted=True))
        unsorted_us = self.time(lambda: torch.topk(scores, TOP_K, dim=1, sorted=False))
        res = TopkResult(batch, length, source, sorted_us, unsorted_us, kernel_us, sorted_us / kernel_us,
                         unsorted_us / kernel_us, float((paths == 1).float().mean()), triton_us, same)
        logger.info("%s", res)
        self.report.topk.append(res)

    def topk_case(self, batch: int, length: int) -> None:
        gen = torch.Generator(device=DEVICE).manual_seed(batch + length)
        scores = torch.randn(batch, length, device=DEVICE, generator=gen)
        self.topk_timing(batch, length, "randn", scores, torch.full((batch,), length, device=DEVICE))

    def config_sweep(self) -> None:
        batch, length = SWEEP_SHAPE
        args = self.inputs(batch, length, 1)
        shapes = [(64, 4, 3, None), (64, 4, 4, None), (64, 4, 5, None), (64, 4, 6, None), (64, 8, 5, None),
                  (128, 4, 5, None), (128, 8, 4, None), (128, 8, 5, None), (64, 4, 5, 8), (64, 4, 5, 32),
                  (64, 4, 5, 64)]
        if SMOKE:
            shapes = shapes[:1]
        for precision in PRECISIONS:
            for block_n, warps, stages, per_prog in shapes:
                cfg = FastScoresConfig(precision=precision, block_n=block_n, num_warps=warps, num_stages=stages,
                                       blocks_per_program=per_prog)

                def one(cfg: FastScoresConfig = cfg) -> None:
                    scores = indexer_scores_fast(*args, cfg)
                    us = self.time(lambda: indexer_scores_fast(*args, cfg))
                    gbps = batch * length * BYTES_PER_POSITION / (us * 1e-6) / 1e9
                    entry = {"config": asdict(cfg), "us": us, "gbps": gbps,
                             "hbm_fraction": self.fraction(batch * length * BYTES_PER_POSITION, us),
                             "score_err": score_error(scores, *args[:5])}
                    logger.info("config %s", entry)
                    self.report.configs.append(entry)

                self.guarded(f"config {cfg}", one)

    def run(self) -> None:
        self.report.hbm_copy_gbps = hbm_copy_gbps()
        torch.cuda.empty_cache()
        logger.info("HBM copy: %.0f GB/s (read + write)", self.report.hbm_copy_gbps)
        sink = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        self.report.event_floor_us = time_gpu_us(lambda: sink.fill_(1))
        logger.info("a one-element fill timed with events: %.1f us", self.report.event_floor_us)
        if not self.args.no_main:
            for batch in SCORE_BATCHES:
                for length in SCORE_LENGTHS:
                    self.guarded(f"scores B {batch} L {length}", lambda b=batch, n=length: self.scores_case(b, n))
            for batch, length in MIXED_SHAPES:
                for lengths in ("equal", "mixed"):
                    self.guarded(f"{lengths} lengths B {batch} L {length}",
                                 lambda b=batch, n=length, kind=lengths: self.mixed_case(b, n, kind))
            for batch in TOPK_BATCHES:
                for length in TOPK_LENGTHS:
                    self.guarded(f"topk B {batch} L {length}", lambda b=batch, n=length: self.topk_case(b, n))
        if self.args.configs:
            self.config_sweep()
        self.save()
        self.print_tables()

    def print_tables(self) -> None:
        r = self.report
        print(f"\nLightning indexer, {r.device}, H={HEADS}, top-k {TOP_K}, {r.layout} keys, times in us "
              f"(median, L2 flushed by a {self.args.flush}); HBM copy {r.hbm_copy_gbps:.0f} GB/s (read + write)")
        if r.configs:
            print(f"\nscores kernel launch shapes, B {SWEEP_SHAPE[0]}, L {SWEEP_SHAPE[1]}:")
            for c in sorted(r.configs, key=lambda c: c["us"]):
                cfg = c["config"]
                print(f"  {cfg['precision']:>6} BLOCK_N {cfg['block_n']:3d} warps {cfg['num_warps']} stages "
                      f"{cfg['num_stages']} per-prog {cfg['blocks_per_program']}: {c['us']:7.1f} us "
                      f"{c['hbm_fraction']:5.1%} HBM  err {c['score_err']:.1e}")
        if not r.scores and not r.topk:
            return self.print_errors()
        names = [READ_FLOOR, "previous fp16x2"] + [f"fast {p}" for p in PRECISIONS] + [E4M3_Q, AFTER_WRITE]
        print("\nscores: us, GB/s, fraction of the HBM copy (score err); the first column reads the same bytes")
        self.print_scores(names, 27, lambda s: f"{s.us:7.1f} {s.gbps:5.0f} {s.hbm_fraction:5.1%} ({s.score_err:.0e})")
        print(f"\nscores in a replayed graph (what a call adds to a graph of L2 flushes): us, fraction of the copy "
              f"(events); events around a one-element fill: {r.event_floor_us:.1f} us")
        self.print_scores(GRAPH_TIMED, 23, lambda s: f"{s.graph_us:7.1f} {s.graph_hbm_fraction:7.1%} ({s.us:5.1f})")
        for wr in r.index_writes:
            print(f"index-key write, B {wr.batch}, in the graph: {wr.kernel_us:.1f} us (the two indexed assignments "
                  f"it replaced: {wr.indexed_us:.1f} us)")
        for quant in r.query_quant:
            print(f"query to e4m3, B {quant.batch}: {quant.quantize_us:.1f} us (the multiply it replaces: "
                  f"{quant.multiply_us:.1f} us)")
        if r.chains:
            print("\nchains (one graph each), us: query → scores as float q / e4m3 q (rotation apart) / one-kernel "
                  "query chain; keys: separate / one kernel")
            for c in r.chains:
                print(f"{c.batch:3d} {c.length:6d} | {c.float_q_us:7.1f} {c.e4m3_q_us:7.1f} {c.one_kernel_q_us:7.1f} | "
                      f"keys {c.keys_separate_us:5.1f} {c.keys_one_kernel_us:5.1f}")
        if r.mixed:
            print("\nequal and mixed lengths (uniform in [L/8, L]): e4m3 q after the key write, in a graph, us and "
                  "fraction of the copy over the batch's positions; per-query kernel vs balanced (the default)")
            for m in r.mixed:
                print(f"{m.batch:3d} {m.length:6d} {m.lengths:>5} | per-query {m.per_query_us:7.1f} "
                      f"{m.per_query_fraction:5.1%} | balanced {m.balanced_us:7.1f} {m.balanced_fraction:5.1%} | "
                      f"{m.per_query_us / m.balanced_us:4.2f}x | same {m.same}")
        print("\ntop-k of 2048: us (torch.topk sorted / unsorted / the CUDA kernel / the Triton kernel), speed-up of "
              "the CUDA kernel; Triton's fast-path rows; the two kernels' positions equal")
        print(f"{'B':>3} {'L':>6} {'scores':>14} | {'sorted':>8} {'unsorted':>8} {'cuda':>7} {'triton':>7} | "
              f"{'vs sorted':>9} {'vs unsorted':>11} | fast path | same")
        for t in sorted(r.topk, key=lambda t: (t.source, t.batch, t.length)):
            print(f"{t.batch:3d} {t.length:6d} {t.source:>14} | {t.torch_sorted_us:8.1f} {t.torch_unsorted_us:8.1f} "
                  f"{t.kernel_us:7.1f} {t.triton_us:7.1f} | {t.speedup_vs_sorted:8.1f}x {t.speedup_vs_unsorted:10.1f}x"
                  f" | {t.fast_path_fraction:.2f} | {t.same}")
        print("\nwhole call (scores + top-k): previous path vs indexer_topk_fast, set overlap mean/min")
        for c in r.calls:
            print(f"{c.batch:3d} {c.length:6d} | {c.previous_us:8.1f} {c.new_us:8.1f} | {c.speedup:5.2f}x | "
                  f"{c.overlap_mean:.4f}/{c.overlap_min:.4f}")
        self.print_errors()

    def print_scores(self, names: Sequence[str], width: int, cell: Callable[[ScoresResult], str]) -> None:
        """One row per (B, L) of the scores cases, one `cell` per kernel in `names` ("-" where not run)."""
        print(f"{'B':>3} {'L':>6} | " + " | ".join(f"{n:>{width}}" for n in names))
        found = {(s.batch, s.length, s.kernel): s for s in self.report.scores}
        for batch, length in sorted({(s.batch, s.length) for s in self.report.scores}):
            cells = [cell(found[batch, length, name]) if (batch, length, name) in found else f"{'-':>{width}}"
                     for name in names]
            print(f"{batch:3d} {length:6d} | " + " | ".join(cells))

    def print_errors(self) -> None:
        if self.report.errors:
            print(f"\n{len(self.report.errors)} case(s) failed:")
            for err in self.report.errors:
                print("  " + err)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", action="store_true", help="also time the new kernel's launch shapes")
    parser.add_argument("--no-main", action="store_true", help="skip the main cases (with --configs: the sweep only)")
    parser.add_argument("--layout", choices=("paged", "rows"), default="paged",
                        help="token rows: random pages of 64 consecutive rows (engine) or random rows")
    parser.add_argument("--flush", choices=("read", "write"), default="read",
                        help="evict the L2 before each timed call by reading (default) or zeroing a 256 MiB buffer")
    parser.add_argument("--json", type=Path, help="write the results here (rewritten after every case)")
    parser.add_argument("--smoke", action="store_true", help="CPU check of the script (interpreter, tiny shapes)")
    args = parser.parse_args()
    Bench(args).run()


if __name__ == "__main__":
    main()

