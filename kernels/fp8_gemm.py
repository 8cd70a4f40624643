"""Block-FP8 linear layers: `fp8_linear` (dense), `fp8_grouped_linear` (the experts of a MoE batch) and
`fp8_batched_linear` (one matrix per group: MLA's absorbed products per head, kernels/fp8_bmm_triton.py), and the
per-process autotuner that picks, by measurement, which GPU backend runs each shape.

Backends (both take the same FP8 activations from `fp8_gemm_triton.quantize_activations`, so they differ only by
their accumulation order):
  - "scaled_mm": `torch._scaled_mm` with DeepSeek's recipe (1×128 activation scales × 128×128 weight scales,
    float32; cuBLAS on SM90 with CUDA ≥ 12.9). The layout it takes: activation scales [M, K/128] with M
    contiguous (we store them group-major [K/128, M_pad] and pass the transpose), M padded to a multiple of 4
    (16-byte aligned scale columns), the weight [N, K] row-major passed transposed (column-major [K, N]), weight
    scales [N/128, K/128] contiguous passed transposed; N and K multiples of 16. We offer it only where K is a
    multiple of 128 with K/128 a multiple of 4, where no torch version's layout check wants the weight scales'
    K blocks padded. Dense only (torch has no block-scaled grouped GEMM).
  - "triton": kernels/fp8_gemm_triton.py (any shape, grouped too), with a launch configuration per shape.

Choice per shape (`Fp8GemmTuner`): the key is (kind "dense" / "grouped" / "batched", N, K, experts (batched: the
groups), M bucket (batched: rows per group), output dtype, device, block); M buckets are powers of two. Two modes ($HISPARSE_FP8_GEMM_TUNING):
  - "table" (the default): the choice comes from the GPU model's tuned table (kernels/fp8_gemm_table.py,
    kernels/fp8_gemm_tables/), else the untimed default Triton configuration. Nothing is timed, so every process
    on the same GPU model decides the same: replicas, and servers with and without CUDA graphs, give the same bits.
  - "measure": the per-process autotuner below (what benchmarks/tune_fp8_gemm.py runs to write the tables).
In "measure" mode, on the first call of a key outside CUDA-graph capture — normally the engine's warm-up,
which tunes every shape of the model at every bucket it can run before any graph is captured
(decode_server/model/fp8_warmup.py) — every candidate (scaled_mm where supported, a few Triton configurations) is
checked against the default Triton configuration's output (a candidate that disagrees is rejected with a warning),
then all that agree are timed together (`_time_us`) on the given weights of that shape (the model's layers, rotated,
plus random copies until they exceed twice the L2 cache, so the cache flatters no candidate): each candidate's
calls are captured into one CUDA graph, since graph replay is what the server runs (timing eager calls let host
launch overhead and clock state in: on an H100 it read every candidate of two small projections ~3× too high and
picked split-K 1 at 42–50 µs over split-K 8 at 15–17 µs); the graphs are replayed in turns, one replay of each a
round, so that drift (clocks, heat) hits every candidate alike rather than favouring the ones timed first, and each
candidate's time is its fastest round. A candidate whose calls cannot be captured is rejected. The fastest is kept
for the life of the process. A shape therefore always runs the same kernel afterwards: results are deterministic
within a process (HiSparse == dense and graph replay == eager rely on it). A key first met during CUDA-graph capture
gets the default Triton configuration untimed, and keeps it. Choices are logged at INFO.

`HISPARSE_FP8_GEMM=auto|triton|scaled_mm` (or the `force_backend` context) restricts the candidates; with
`scaled_mm`, shapes it does not support (grouped; K/128 not a multiple of 4) still use Triton. On CPU both
functions run the references of kernels/fp8_gemm_ref.py (float32 with the activation rounding emulated).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kernels.fp8_gemm_ref import fp8_bmm_ref, fp8_grouped_ref, fp8_linear_ref

logger = logging.getLogger(__name__)

BACKEND_ENV = "HISPARSE_FP8_GEMM"
BACKENDS = ("auto", "triton", "scaled_mm")
TUNING_ENV = "HISPARSE_FP8_GEMM_TUNING"
TUNING_MODES = ("table", "measure")
MAX_M_BUCKET = 16384
SCALED_MM_ROW_ALIGN = 4
_SPIN_CYCLES = 200_000  # ~0.1 ms of GPU spin before each timed replay: the host enqueues the replay behind it
_TIMED_ROUNDS = 5
_MIN_CALLS = 4
_MAX_CALLS = 32
_TIMED_BATCH_US = 1500.0
_MAX_RANDOM_COPIES = 64
_AGREEMENT = 2.0**-6  # candidates must agree with the default Triton kernel within this share of max |y|
# Rows up to which the fused variants (quantization and split-K sum inside the GEMM) of the dense kernel are
# candidates and the default: each column tile quantizes the rows again, which stops paying as M grows. The grouped
# kernel's fused variants are not offered: every (column tile, expert) program repeats the quantization, and they
# measured 1.2-3x slower than quantizing once at every tuned shape (H100, 2026-11-26).
FUSED_MAX_ROWS = 16
# The one-row kernel's launch shapes (rows a program, 128-channel groups a loop step, warps, quantization inside,
# loop stages): the winners of a sweep of 10 over the DeepSeek-V3.2 projections at M = 1 (H100, 2026-11-27;
# docs/kernels.md), each also with its loop pipelined 3 deep (`gemv_stages`) for the dense kernel. The grouped
# kernel's per-expert form has its loop inside its loop over an expert's rows, where Triton 3.6 does not pipeline
# the weight tiles; its row-program form (a program per row, `gemv_row_programs`) has one loop and takes both.
_GEMV_SHAPES = ((8, 4, 4, False), (16, 4, 4, False), (16, 8, 8, False), (32, 4, 4, True), (16, 4, 4, True))
GEMV_CANDIDATES = tuple((*shape, stages) for stages in (1, 3) for shape in _GEMV_SHAPES)
GROUPED_GEMV_CANDIDATES = tuple((*shape, 1) for shape in _GEMV_SHAPES)
GROUPED_GEMV_ROW_CANDIDATES = GEMV_CANDIDATES
# The grouped one-row kernel reads an expert's weights once per row: offered while the rows an active expert gets
# average at most this many (decode's small batches).
GEMV_MAX_ROWS_PER_EXPERT = 2

Weights = Sequence[tuple[torch.Tensor, torch.Tensor]]


# The source of a table-mode decision whose key this GPU's table lacks: the default configuration runs, untimed.
NO_TABLE_ENTRY = "no table entry: default"
# Dense keys the table lacks from this M bucket on (prefill chunks: the shipped tables stop at decode's 256) take
# cuBLAS's block-FP8 GEMM where it runs: summed over ten DeepSeek-V3.2 and GLM-5 shapes it took 0.55-0.57x the
# default Triton configuration's time at M 512, 0.47x at 2048 and 0.44x at 8192 on an H200 (per shape 0.36-0.86x
# from 2048 on, 0.36-1.25x at 512; docs/kernels.md).
UNTABLED_SCALED_MM_MIN_BUCKET = 512
UNTABLED_SCALED_MM = "no table entry, prefill size: scaled_mm"


def m_bucket(m: int) -> int:
    """Smallest power of two ≥ m (1 for m ≤ 1), capped at MAX_M_BUCKET."""
    return min(1 << max(0, m - 1).bit_length(), MAX_M_BUCKET)


@dataclass(frozen=True)
class GemmChoice:
    """What runs one shape: "scaled_mm", or "triton" with its launch configuration."""

    backend: str
    config: object | None = None  # kernels.fp8_gemm_triton.TritonGemmConfig for "triton"

    def label(self) -> str:
        return self.config.label() if self.config is not None else self.backend  # type: ignore[attr-defined]


@dataclass
class TuningRecord:
    """One key's decision: what was chosen, and each candidate's measured µs per call (empty if untimed)."""

    kind: str
    n: int
    k: int
    experts: int
    bucket: int
    choice: GemmChoice
    timings_us: dict[str, float] = field(default_factory=dict)
    rejected: list[str] = field(default_factory=list)
    source: str = ""  # table mode: where the choice came from ("table", NO_TABLE_ENTRY, ...)

    @property
    def best_us(self) -> float | None:
        return self.timings_us.get(self.choice.label())

    def best_of(self, backend: str) -> float | None:
        """Fastest measured time of one backend's candidates."""
        times = [t for label, t in self.timings_us.items() if label.split()[0] == backend]
        return min(times) if times else None


_forced: list[str] = []


def forced_backend() -> str:
    """The backend restriction in force: the innermost `force_backend`, else $HISPARSE_FP8_GEMM, else "auto"."""
    value = _forced[-1] if _forced else (os.environ.get(BACKEND_ENV, "") or "auto").strip().lower()
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={value!r}: expected one of {BACKENDS}")
    return value


@contextlib.contextmanager
def force_backend(name: str) -> Iterator[None]:
    """Restrict the backends (tests, benchmarks). Choices cached earlier stay: give the calls a fresh tuner
    (`reset_tuner()`) to decide again under the restriction."""
    if name not in BACKENDS:
        raise ValueError(f"unknown FP8 GEMM backend {name!r}; expected one of {BACKENDS}")
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()


def tuning_mode() -> str:
    """$HISPARSE_FP8_GEMM_TUNING: "table" (default) or "measure"."""
    value = (os.environ.get(TUNING_ENV, "") or "table").strip().lower()
    if value not in TUNING_MODES:
        raise ValueError(f"{TUNING_ENV}={value!r}: expected one of {TUNING_MODES}")
    return value


def _triton():
    from kernels import fp8_gemm_triton  # on first GPU use: Triton is not needed on CPU

    return fp8_gemm_triton


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _l2_bytes(device_index: int) -> int:
    return int(getattr(torch.cuda.get_device_properties(device_index), "L2_cache_size", 0) or 50 << 20)


def _index(device: torch.device) -> int:
    if device.index is not None or device.type != "cuda":
        return device.index or 0
    return torch.cuda.current_device()


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def scaled_mm_supported(n: int, k: int, block: tuple[int, int], device: torch.device) -> bool:
    """Whether torch._scaled_mm's blockwise path may run a dense [N, K] weight on this device."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm") or tuple(block) != (128, 128):
        return False
    if _capability(_index(device)) != (9, 0):
        return False  # cuBLAS's 1×128 / 128×128 block scaling exists on Hopper only
    return n > 0 and n % 16 == 0 and k % 128 == 0 and (k // 128) % 4 == 0


def _scaled_mm(q: torch.Tensor, scales: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """q [M_pad, K] e4m3 with scales [K/128, M_pad] → [M_pad, N] out_dtype."""
    return torch._scaled_mm(q, w.t(), scale_a=scales.t(), scale_b=w_scale.t(), out_dtype=out_dtype)


def triton_candidates(kind: str, bucket: int, n: int, k: int, experts: int, device: torch.device) -> list[GemmChoice]:
    """Triton launch configurations worth timing for a shape: row tile by the rows per weight, both column
    tiles, and split-K only while the grid is under two waves (split-K buys parallelism, nothing else)."""
    config = _triton().TritonGemmConfig
    sms = _sm_count(_index(device))
    k_tiles = max(1, math.ceil(k / 128))
    if kind == "batched":
        return _batched_candidates(bucket, n, k, config)
    if kind == "grouped":
        active = max(1, min(experts, bucket))  # experts that `bucket` routed rows can reach
        rows = math.ceil(bucket / active)
    else:
        active, rows = 1, bucket
    # (row tile, column tiles): few distinct tiles, since each is a Triton compilation. Grouped: the rows per
    # expert only average `rows` (routing is uneven), and an expert over one row tile reads its weights once more,
    # so the next row tile is a candidate too once `rows` fills half of a tile.
    tiles = ([(16, (64, 128))] if rows <= 16 else [(32, (64, 128))] if rows <= 32 else [(64, (64, 128))]
             if rows <= 64 else [(64, (128,)), (128, (128,))])
    if kind == "grouped" and rows <= 32 and 2 * rows >= tiles[0][0]:
        tiles.append((2 * tiles[0][0], (64,)))
    layouts = [(bm, column_tiles, min(8, 1 << (math.ceil(rows / bm) - 1).bit_length()) if kind == "grouped" else 1)
               for bm, column_tiles in tiles]
    if kind == "grouped" and bucket > 2 * tiles[0][0] and layouts[0][2] < 8:
        # One expert can hold far more rows than the average: a fused shared expert has a row of every token (at
        # batch 16 of a top-2 model 16 of 48 rows, at 21 tokens 21 — two row tiles, which one program runs one
        # after the other). So the smallest tile also with twice the programs along M.
        bm, column_tiles, m_programs = layouts[0]
        layouts.append((bm, column_tiles[:1], 2 * m_programs))
    out = []
    for bm, column_tiles, m_programs in layouts:
        m_tiles = math.ceil(rows / bm)
        for bn in column_tiles:
            programs = active * (min(m_programs, m_tiles) if kind == "grouped" else m_tiles) * math.ceil(n / bn)
            splits = [1]
            if programs < 2 * sms:
                splits += [s for s in (2, 4, 8, 16, 32) if s <= k_tiles // 2 and programs * s <= 4 * sms]
            warps = 8 if bm * bn >= 128 * 128 else 4
            stages = 3 if bm >= 128 else 4
            out += [GemmChoice("triton", config(bm, bn, s, warps, stages, m_programs)) for s in splits]
            if kind == "grouped" and bm < 128:
                out += [GemmChoice("triton", config(bm, bn, s, warps, 3, m_programs)) for s in splits]
            if kind == "dense" and rows <= FUSED_MAX_ROWS:  # the fused variants: one kernel instead of up to three
                out += [GemmChoice("triton", config(bm, bn, s, warps, stages, m_programs, fuse_quant=True,
                                                    fuse_reduce=s > 1)) for s in splits]
    if kind == "grouped":
        out += _grouped_extra_candidates(bucket, rows, tiles, layouts, config)
    if (kind == "dense" and bucket == 1) or (kind == "grouped" and rows <= GEMV_MAX_ROWS_PER_EXPERT):
        # One row (an expert's one or two): the kernel without tensor cores (`fp8_gemv`, `fp8_grouped_gemv`)
        out += [GemmChoice("triton", config(block_n=bn, num_warps=warps, gemv_groups=groups, fuse_quant=fused,
                                            gemv_stages=stages))
                for bn, groups, warps, fused, stages in (GEMV_CANDIDATES if kind == "dense" else GROUPED_GEMV_CANDIDATES)]
        if kind == "grouped" and bucket <= _triton().MAX_GRID_Y:
            # A program per (column block, row): at decode most of the per-expert form's programs find no rows and
            # the few that do are too few to keep HBM busy (H200, batch 1: 46 % of the copy rate).
            out += [GemmChoice("triton", config(block_n=bn, num_warps=warps, gemv_groups=groups, fuse_quant=fused,
                                                gemv_stages=stages, gemv_row_programs=True))
                    for bn, groups, warps, fused, stages in GROUPED_GEMV_ROW_CANDIDATES]
    return out


def _grouped_extra_candidates(bucket: int, rows: int, tiles: list, layouts: list, config: type) -> list[GemmChoice]:
    """The grouped kernel's launches for decode's uneven rows, beyond the row tile of the average: a tile of 64
    rows (one pass over the weights for every expert up to 64 rows: a fused shared expert holds a row of every
    token, routed experts of a top-8-of-32 rank about a quarter of the tokens) with 3 stages and 128 registers a
    thread, in both expert orders; and the two-programs-per-expert layout with the last expert's programs first.

    Why (H200, 2026-11-28, the rank shapes at batch 42, 378 rows over 33 experts; bench records in
    benchmarks/results/grouped_gemm_rank_2026-11-28/): a program of a 32-row tile runs the shared expert's 42 rows
    as two passes over its weights in the programs the grid starts last, so the GEMM ends on their tail (GLM-5
    gate/up 296 µs against 225 with the 64-row tile at 128 registers; down 148 against 119 with two programs per
    expert, the last expert first)."""
    out: list[GemmChoice] = []
    if rows >= 8 and bucket > 2 * tiles[0][0] and all(bm != 128 for bm, _ in tiles):
        out += [GemmChoice("triton", config(64, 64, 1, 4, 3, 1, max_registers=128, experts_reversed=reverse))
                for reverse in (False, True)]
    shared_layouts = [(bm, column_tiles, m_programs) for bm, column_tiles, m_programs in layouts if m_programs > 1]
    for bm, column_tiles, m_programs in shared_layouts[-1:]:
        out += [GemmChoice("triton", config(bm, column_tiles[0], 1, 4, stages, m_programs, experts_reversed=True))
                for stages in (4, 3)]
    return out


def _batched_candidates(rows: int, n: int, k: int, config: type) -> list[GemmChoice]:
    """The batched kernel's configurations (kernels/fp8_bmm_triton.py; `rows` per group): tensor-core tiles by the
    rows, both column tiles, quantization always inside, no split-K (the groups fill the GPU); up to
    GEMV_MAX_ROWS_PER_EXPERT rows also the one-row kernel, reading 1 or up to 4 of K's 128-channel groups a step."""
    bm = 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 64 else 128
    # Also half the row tile above 16 rows: twice the programs, since a group with few column tiles (W_UV: N = 128)
    # gives the GPU only about one program per group (measured: 128 programs for 128 heads lost to bf16 at 64 rows).
    out = [GemmChoice("triton", config(tile, bn, 1, 8 if tile >= 128 else 4, 3 if tile >= 128 else 4,
                                       fuse_quant=True))
           for tile in ((bm, bm // 2) if bm > 16 else (bm,)) for bn in (64, 128) if bn <= max(64, n)]
    if rows <= GEMV_MAX_ROWS_PER_EXPERT:
        k_groups = max(1, math.ceil(k / 128))
        steps = sorted({1, 1 << (min(4, k_groups).bit_length() - 1)})  # power-of-two loop steps
        out += [GemmChoice("triton", config(block_n=bn, num_warps=4, gemv_groups=g, fuse_quant=True))
                for bn in (16, 32, 64) for g in steps]
    return out


def default_choice(kind: str, bucket: int, n: int, k: int, experts: int, device: torch.device) -> GemmChoice:
    """The untimed choice: the first column tile, split-K up to about one wave; fused where the fused variants
    are candidates (small M). Batched: the first tensor-core tile."""
    candidates = [c for c in triton_candidates(kind, bucket, n, k, experts, device) if not c.config.gemv_groups]
    if kind == "batched":
        return candidates[0]
    bn = candidates[0].config.block_n
    fused = any(c.config.fuse_quant for c in candidates)
    first = candidates[0].config
    candidates = [c for c in candidates if c.config.block_n == bn and c.config.block_m == first.block_m
                  and c.config.m_programs == first.m_programs and c.config.fuse_quant == fused
                  and c.config.num_stages == first.num_stages and not c.config.max_registers
                  and not c.config.experts_reversed]
    sms = _sm_count(_index(device))
    rows = bucket if kind == "dense" else max(1, math.ceil(bucket / max(1, min(experts, bucket))))
    base = math.ceil(n / bn) * math.ceil(rows / candidates[0].config.block_m)
    fitting = [c for c in candidates if base * c.config.split_k <= 2 * sms]
    return fitting[-1] if fitting else candidates[0]


class Routing(NamedTuple):
    """How decode routes a grouped GEMM's rows (the engine's warm-up knows it, a table key does not): each token's
    `experts_per_token` distinct routed experts, plus one row on the last expert where it is a fused shared
    expert (`shared_last`; decode_server/model/moe.py)."""

    experts_per_token: int
    shared_last: bool = False


def grouped_routing_samples(bucket: int, experts: int, routing: Routing | None = None) -> list[list[int]]:
    """The routings a grouped GEMM of M bucket `bucket` over `experts` experts is timed on (sorted expert ids of its
    rows), at the bucket's two ends: every M of the bucket runs the one choice.

    With `routing` (and token counts whose rows fall in the bucket): the fewest and the most such tokens, each
    routed to `experts_per_token` distinct experts drawn at random (fixed seed) among the routed ones, plus its
    shared-expert row — so a fused shared expert holds a row of every token, as in the step (at batch 64 of a
    top-2 model: 64 of 192 rows). Otherwise bucket/2 + 1 and bucket rows spread evenly, each row its own expert
    while rows ≤ experts.

    Why not one uniform random draw of `bucket` rows (the tuner until 2026-11-27): with replacement it lands on
    fewer experts than decode's distinct top-k, and a tile kernel reads an expert's weights once however many of
    its rows there are, so such a draw flattered it; and it spreads a fused shared expert's rows over all experts.
    Measured (H200, dsv32-bench-16l, batch 1): the choices it made for the fused E+1 gate/up and down at bucket 4
    cost 69.6 µs a MoE layer in the step's graph, the one-row kernels that 3 rows on 3 experts pick 60.5; and even
    samples without the shared expert's rows picked 32-row tiles at bucket 256, whose 64 shared rows then run two
    tiles in one program: batch 64's step 8.51 → 9.25 ms."""
    per_token = routing.experts_per_token + int(routing.shared_last) if routing is not None else 0
    routed = experts - int(routing.shared_last) if routing is not None else experts
    if routing is not None and 0 < routing.experts_per_token <= routed and per_token <= bucket:
        low = max(1, (bucket // 2) // per_token + 1) if bucket > 1 else 1
        high = bucket // per_token
        gen = torch.Generator().manual_seed(bucket * 1009 + experts)
        samples = []
        for tokens in sorted({min(low, high), high}):
            ids = [int(e) for _ in range(tokens)
                   for e in torch.randperm(routed, generator=gen)[: routing.experts_per_token]]
            ids += [experts - 1] * (tokens if routing.shared_last else 0)
            samples.append(sorted(ids))
        return samples
    rows = sorted({bucket // 2 + 1, bucket}) if bucket > 1 else [1]
    return [[(row * experts) // count for row in range(count)] for count in rows]


def _random_weights(shape: tuple[int, ...], block: tuple[int, int], device: torch.device,
                    gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(shape, device=device, generator=gen).mul_(64).clamp_(-448, 448).to(torch.float8_e4m3fn)
    scale_shape = (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))
    return w, torch.rand(scale_shape, device=device, generator=gen).add_(0.5).mul_(2.0**-10)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@functools.cache
def _capture_stream(device_index: int) -> torch.cuda.Stream:
    """The side stream the tuner warms up and captures on: one per device for all tuning, since the fused split-K
    kernels keep one counter buffer per stream for the life of the process (kernels/fp8_gemm_triton.py)."""
    return torch.cuda.Stream(device=device_index)


# Graph objects whose capture was invalidated, kept for the life of the process: torch (2.11) then leaves the capture
# registered with its pinned-host allocator, through a filter that points at the graph object, and no Python call
# removes that registration (nor may its pool be captured into again).
_FAILED_CAPTURES: list[torch.cuda.CUDAGraph] = []


def _capture(fn: Callable[[int], object], calls: int, pool: tuple[int, int],
             stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph | None:
    """fn(0) once eagerly on `stream` (compilation, lazily allocated buffers kept outside the graph), then fn(0) …
    fn(calls-1) captured into one CUDA graph on `stream` from the memory pool `pool`; None if either raises."""
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream()
    try:
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            fn(0)
        # "thread_local": a sync inside the candidate's own calls still breaks the capture, but other threads of
        # the process (the tuner runs during the engine's warm-up) are not refused their CUDA calls meanwhile.
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            for i in range(calls):
                fn(i)
    except Exception as exc:  # noqa: BLE001 - reported as NaN: the caller rejects the candidate
        # An invalidated capture makes torch.cuda.graph's exit raise from capture_end before it restores the
        # current stream and before the caching allocator stops routing this thread's allocations to `pool`.
        torch.cuda.set_stream(current)
        torch.cuda.synchronize()
        registered = True
        end_allocating = getattr(torch._C, "_cuda_endAllocateToPool", None)
        if end_allocating is not None:
            try:
                end_allocating(torch.cuda.current_device(), pool)
            except RuntimeError:  # not recording: the capture never began, or capture_end got past that step
                registered = False
        if registered:
            _FAILED_CAPTURES.append(graph)
        logger.info("FP8 GEMM tuning: a candidate's calls cannot be captured in a CUDA graph: %s: %s",
                    type(exc).__name__, exc)
        return None
    return graph


def _time_us(fns: Sequence[Callable[[int], object]], calls: int) -> list[float]:
    """GPU µs per call of each fn as graph replay runs it: fn(0) … fn(calls-1) captured into one CUDA graph per fn
    (one memory pool for all, so memory stays bounded), the graphs replayed in turns for _TIMED_ROUNDS rounds, each
    replay timed with CUDA events behind a short GPU spin (the host launches ahead of the GPU); each fn's result is
    its fastest round, NaN where its calls cannot be captured."""
    stream = _capture_stream(torch.cuda.current_device())
    pool = torch.cuda.graph_pool_handle()
    graphs: list[torch.cuda.CUDAGraph | None] = []
    for fn in fns:
        graph = _capture(fn, calls, pool, stream)
        if graph is None:
            pool = torch.cuda.graph_pool_handle()  # a pool whose capture failed cannot be captured into again
        graphs.append(graph)
    timed = [(index, graph) for index, graph in enumerate(graphs) if graph is not None]
    for _, graph in timed:
        graph.replay()  # untimed: a graph's first launch also uploads it
    rounds = []
    for _ in range(_TIMED_ROUNDS):
        events = []
        for _, graph in timed:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(_SPIN_CYCLES)
            start.record()
            graph.replay()
            end.record()
            events.append((start, end))
        rounds.append(events)
    torch.cuda.synchronize()
    times = [math.nan] * len(fns)
    for position, (index, _) in enumerate(timed):
        fastest_ms = min(events[position][0].elapsed_time(events[position][1]) for events in rounds)
        times[index] = fastest_ms * 1000.0 / calls
    del timed, graphs  # the graphs' pool is released once no graph refers to it
    return times


def _reject(record: TuningRecord, label: str, reason: str) -> None:
    """Record and log a candidate that will not be chosen (its output disagrees, it raised, or it cannot be
    captured in a CUDA graph)."""
    record.rejected.append(f"{label}: {reason}")
    logger.warning("FP8 GEMM %s N=%d K=%d M≤%d: candidate %s rejected: %s", record.kind, record.n, record.k,
                   record.bucket, label, reason)


class Fp8GemmTuner:
    """The per-process cache of backend choices (see the module docstring)."""

    def __init__(self, mode: str | None = None) -> None:
        self.mode = mode if mode is not None else tuning_mode()
        if self.mode not in TUNING_MODES:
            raise ValueError(f"unknown FP8 GEMM tuning mode {self.mode!r}; expected one of {TUNING_MODES}")
        self._choices: dict[tuple, GemmChoice] = {}
        self._lock = threading.RLock()
        self.records: list[TuningRecord] = []
        self.frozen = False  # set: a key not decided yet gets the default configuration, untimed

    def cached(self, key: tuple) -> GemmChoice | None:
        return self._choices.get(key)

    def export(self) -> list[tuple[tuple, GemmChoice]]:
        """The decisions, device-independent (tensor-parallel rank 0 sends them to the other ranks)."""
        return [(key[:6] + key[7:], choice) for key, choice in self._choices.items()]

    def install(self, entries: list[tuple[tuple, GemmChoice]], device: torch.device) -> None:
        """Adopt another process's decisions for `device` (every rank must run the same kernel for the
        replicated layers — the indexer and the latent KV projection — so that their outputs are identical)."""
        with self._lock:
            for key, choice in entries:
                self._choices[key[:6] + (_index(device),) + key[6:]] = choice

    def choose(self, kind: str, n: int, k: int, experts: int, m: int, dtype: torch.dtype, device: torch.device,
               weights: Weights, block: tuple[int, int], routing: Routing | None = None) -> GemmChoice:
        """The choice for (kind, N, K, experts, M's bucket); decided on first use (table, timing or default).
        `routing`: how decode routes a grouped GEMM's rows, for its timing (`grouped_routing_samples`)."""
        bucket = m_bucket(m)
        key = (kind, n, k, experts, bucket, dtype, device.index, tuple(block))
        choice = self._choices.get(key)
        if choice is not None:
            return choice
        with self._lock:
            choice = self._choices.get(key)
            if choice is None:
                choice = self._decide(key, weights, device, routing)
                self._choices[key] = choice
        return choice

    def _decide(self, key: tuple, weights: Weights, device: torch.device,
                routing: Routing | None = None) -> GemmChoice:
        kind, n, k, experts, bucket, dtype, index, block = key
        default = default_choice(kind, bucket, n, k, experts, device)
        if self.frozen:
            logger.info("FP8 GEMM %s N=%d K=%d M≤%d not decided at warm-up: default %s (decisions frozen)", kind, n,
                        k, bucket, default.label())
            self.records.append(TuningRecord(kind, n, k, experts, bucket, default))
            return default
        restriction = forced_backend()
        if self.mode == "table":
            choice, source = self._from_table(key, default, restriction, device)
            logger.info("FP8 GEMM %s N=%d K=%d%s M≤%d: %s (%s)", kind, n, k, f" E={experts}" if experts else "",
                        bucket, choice.label(), source)
            self.records.append(TuningRecord(kind, n, k, experts, bucket, choice, source=source))
            return choice
        if _capturing():
            logger.warning("FP8 GEMM %s N=%d K=%d M≤%d first met during CUDA-graph capture: default %s, untimed",
                           kind, n, k, bucket, default.label())
            self.records.append(TuningRecord(kind, n, k, experts, bucket, default))
            return default
        candidates = [] if restriction == "scaled_mm" else triton_candidates(kind, bucket, n, k, experts, device)
        if kind == "dense" and restriction != "triton" and scaled_mm_supported(n, k, block, device):
            candidates.insert(0, GemmChoice("scaled_mm"))
        if not candidates:
            candidates = [default]  # scaled_mm forced on a shape it cannot run
        record = TuningRecord(kind, n, k, experts, bucket, default)
        with torch.inference_mode():
            record.choice = self._measure(record, candidates, default, weights, dtype, device, block, routing)
        self.records.append(record)
        timed = ", ".join(f"{label} {us:.1f}" for label, us in sorted(record.timings_us.items(), key=lambda x: x[1]))
        logger.info("FP8 GEMM %s N=%d K=%d%s M≤%d: %s (µs per call: %s)", kind, n, k,
                    f" E={experts}" if experts else "", bucket, record.choice.label(), timed)
        return record.choice

    @staticmethod
    def _from_table(key: tuple, default: GemmChoice, restriction: str,
                    device: torch.device) -> tuple[GemmChoice, str]:
        """The tuned table's choice for `key` on this GPU model (honouring a forced backend); for a key it lacks,
        `scaled_mm` at prefill sizes (dense, M bucket ≥ UNTABLED_SCALED_MM_MIN_BUCKET) where it runs, else the
        default. A rule, not a timing: every process on the GPU model still decides the same."""
        kind, n, k, experts, bucket, dtype, _index_, block = key
        if restriction == "scaled_mm":
            if kind == "dense" and scaled_mm_supported(n, k, block, device):
                return GemmChoice("scaled_mm"), "forced"
            return default, "forced scaled_mm cannot run it: default"
        if device.type != "cuda":
            return default, "default"
        from kernels.fp8_gemm_table import device_table, dtype_name

        entry = device_table(torch.cuda.get_device_name(_index(device))).get(
            (kind, n, k, experts, bucket, dtype_name(dtype)))
        if entry is None:
            if (kind == "dense" and bucket >= UNTABLED_SCALED_MM_MIN_BUCKET and restriction != "triton"
                    and scaled_mm_supported(n, k, block, device)):
                return GemmChoice("scaled_mm"), UNTABLED_SCALED_MM
            return default, NO_TABLE_ENTRY
        backend, fields = entry
        if backend == "scaled_mm":
            if restriction == "triton" or kind != "dense" or not scaled_mm_supported(n, k, block, device):
                return default, "table's scaled_mm not allowed here: default"
            return GemmChoice("scaled_mm"), "table"
        return GemmChoice("triton", _triton().TritonGemmConfig(**(fields or {}))), "table"

    def _measure(self, record: TuningRecord, candidates: list[GemmChoice], default: GemmChoice, weights: Weights,
                 dtype: torch.dtype, device: torch.device, block: tuple[int, int],
                 routing: Routing | None = None) -> GemmChoice:
        kind, bucket = record.kind, record.bucket
        gen = torch.Generator(device=device).manual_seed(record.n * 131 + record.k)
        pool = list(weights)
        per_weight = pool[0][0].numel() + 4 * pool[0][1].numel()
        while len(pool) < _MAX_RANDOM_COPIES and len(pool) * per_weight < 2 * _l2_bytes(_index(device)):
            pool.append(_random_weights(tuple(pool[0][0].shape), block, device, gen))
        rows = (record.experts, bucket) if kind == "batched" else (bucket,)
        x = torch.randn(*rows, record.k, device=device, generator=gen, dtype=torch.float32).to(dtype)
        # Grouped: one (rows, end offsets) sample per routing of `grouped_routing_samples`; the others: x itself.
        samples: list[tuple[torch.Tensor, torch.Tensor | None]] = [(x, None)]
        if kind == "grouped":
            samples = []
            for ids in grouped_routing_samples(bucket, record.experts, routing):
                sorted_ids = torch.tensor(ids, device=device)
                offsets = torch.searchsorted(sorted_ids, torch.arange(record.experts, device=device),
                                             right=True).to(torch.int32)
                samples.append((x[: len(ids)], offsets))

        def call(choice: GemmChoice, i: int, sample: int = -1) -> torch.Tensor:
            w, s = pool[i % len(pool)]
            rows_x, offsets = samples[sample]
            if kind == "grouped":
                return _run_grouped(choice, rows_x, w, s, offsets, block, dtype)
            if kind == "batched":
                return _run_batched(choice, x, w, s, x.new_empty(record.experts, bucket, record.n), block)
            return _run_dense(choice, x, w, s, block, dtype)

        offsets = samples[-1][1]
        reference = call(default, 0).float()
        limit = _AGREEMENT * float(reference.abs().max()) + 1e-6
        agreeing = []
        for choice in candidates:
            try:
                out = call(choice, 0).float()
                if kind == "grouped":
                    out, ref = out[: int(offsets[-1])], reference[: int(offsets[-1])]
                else:
                    ref = reference
                diff = float((out - ref).abs().max()) if out.numel() else 0.0
                if not diff <= limit:  # also catches NaN
                    raise RuntimeError(f"disagrees with the default Triton kernel by {diff:.3g} (limit {limit:.3g})")
            except Exception as exc:  # noqa: BLE001 - a candidate that cannot run here is simply not chosen
                _reject(record, choice.label(), f"{type(exc).__name__}: {exc}")
                continue
            agreeing.append(choice)
        if agreeing:
            # About 1.5 ms of GPU work per timed replay: short GEMMs get many calls (and every weight copy), long
            # ones (prefill-sized M, weights larger than L2 anyway) a few.
            estimate = _time_us([functools.partial(call, default)], 2)[0]
            calls = (max(_MIN_CALLS, min(_MAX_CALLS, math.ceil(_TIMED_BATCH_US / max(estimate, 1e-3))))
                     if math.isfinite(estimate) else _MIN_CALLS)
            # Each candidate's time: its mean over the routing samples (one for dense and batched).
            per_sample = [_time_us([functools.partial(call, choice, sample=index) for choice in agreeing], calls)
                          for index in range(len(samples))]
            times = [sum(column) / len(column) for column in zip(*per_sample, strict=True)]
            for choice, us in zip(agreeing, times, strict=True):
                if math.isfinite(us):
                    record.timings_us[choice.label()] = us
                else:
                    _reject(record, choice.label(), "cannot be captured in a CUDA graph")
        if not record.timings_us:
            return default
        best = min(record.timings_us, key=record.timings_us.__getitem__)
        return next(c for c in candidates if c.label() == best)


_TUNER = Fp8GemmTuner()


def tuner() -> Fp8GemmTuner:
    return _TUNER


def reset_tuner(mode: str | None = None) -> Fp8GemmTuner:
    """Forget every choice (tests and benchmarks that compare backends in one process); `mode` "table" or
    "measure" (default: $HISPARSE_FP8_GEMM_TUNING)."""
    global _TUNER
    _TUNER = Fp8GemmTuner(mode)
    return _TUNER


def _run_dense(choice: GemmChoice, rows: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
               block: tuple[int, int], out_dtype: torch.dtype,
               quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`quantized`: rows' block-FP8 form where its producer wrote it (`attach_quantized`), used instead of a
    quantization launch by a kernel that reads quantized activations."""
    tri = _triton()
    m = rows.shape[0]
    if choice.backend == "scaled_mm":
        q, scales = tri.quantize_activations(rows, pad_rows_to=SCALED_MM_ROW_ALIGN)
        return _scaled_mm(q, scales, w, w_scale, out_dtype)[:m]
    gemm = tri.fp8_gemv if choice.config.gemv_groups else tri.fp8_gemm
    if choice.config.fuse_quant:
        return gemm(rows, None, m, w, w_scale, out_dtype, choice.config, block)
    q, scales = quantized if quantized is not None else tri.quantize_activations(rows)
    return gemm(q, scales, m, w, w_scale, out_dtype, choice.config, block)


_QUANTIZED_ATTR = "_hisparse_fp8_rows"


def attach_quantized(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Record on x [M, K] its block-FP8 form, (q [M, K] e4m3, scales [K/128, M] float32) exactly as
    `quantize_activations(x)` gives it, written by x's producer in the same launch (kernels/norm_rope_triton.py:
    the RMSNorm before a projection). `fp8_linear(x, …)` then skips its quantization launch where the chosen kernel
    reads quantized activations. Why an attribute on the tensor object: it lives and dies with x (no registry keyed
    by addresses that memory reuse could alias) and a view or copy of x does not carry it (the GEMM then quantizes
    as before). x's version counter is kept where it has one, so that an in-place write to x afterwards voids the
    form; an inference-mode tensor (the engine's) counts no versions, so there the contract is the producer's: it
    attaches only to a fresh output that goes to its consumer unwritten (the model's norms: decode_server/model/
    model.py)."""
    if x.dim() != 2 or tuple(q.shape) != tuple(x.shape) or tuple(scales.shape) != (math.ceil(x.shape[1] / 128),
                                                                                    x.shape[0]):
        raise ValueError(f"quantized form {tuple(q.shape)} / {tuple(scales.shape)} does not fit x {tuple(x.shape)}")
    setattr(x, _QUANTIZED_ATTR, (q, scales, _version(x)))
    return x


def _version(x: torch.Tensor) -> int | None:
    return None if x.is_inference() else x._version


def attached_quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x's block-FP8 form from `attach_quantized`, or None (none attached, or x written in place since)."""
    entry = getattr(x, _QUANTIZED_ATTR, None)
    if entry is None or entry[2] != _version(x):
        return None
    return entry[0], entry[1]


def reads_quantized_input(n: int, k: int, m: int, dtype: torch.dtype, device: torch.device,
                          block: tuple[int, int] = (128, 128)) -> bool:
    """Whether the dense FP8 GEMM of N × K at M rows already chose (this process) a kernel that reads its input
    quantized by a separate launch — what a producer can spare it by writing the quantized form itself
    (`attach_quantized`). False until the shape was first run (warm-up runs it before any graph is captured)."""
    if device.type != "cuda":
        return False
    choice = _TUNER._choices.get(("dense", n, k, 0, m_bucket(m), dtype, device.index, tuple(block)))
    return choice is not None and choice.backend == "triton" and not choice.config.fuse_quant


class SharedInput:
    """One activation tensor that several grouped FP8 GEMMs read (the MoE's gate and up projections): quantized at
    most once, and only when a chosen kernel reads it quantized — a kernel that quantizes inside needs nothing, so
    when both pick such kernels no quantization kernel runs."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self._quantized: tuple[torch.Tensor, torch.Tensor] | None = None

    def quantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [M, K] e4m3, scales [K/128, M] group-major), computed on the first call."""
        if self._quantized is None:
            self._quantized = _triton().quantize_activations(self.x)
        return self._quantized


def _run_grouped(choice: GemmChoice, rows: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                 end_offsets: torch.Tensor, block: tuple[int, int], out_dtype: torch.dtype,
                 shared: SharedInput | None = None) -> torch.Tensor:
    tri = _triton()
    gemm = tri.fp8_grouped_gemv if choice.config.gemv_groups else tri.fp8_grouped_gemm
    if choice.config.fuse_quant:  # quantizes inside the GEMM; a shared quantized form is not needed
        return gemm(rows, None, w, w_scale, end_offsets, out_dtype, choice.config, block)
    q, scales = shared.quantized() if shared is not None else tri.quantize_activations(rows)
    return gemm(q, scales, w, w_scale, end_offsets, out_dtype, choice.config, block)


def _run_batched(choice: GemmChoice, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor,
                 block: tuple[int, int]) -> torch.Tensor:
    from kernels.fp8_bmm_triton import fp8_bmm

    return fp8_bmm(x, w, w_scale, out, choice.config, block)


def dense_shape_tuned(n: int, k: int, device: torch.device) -> bool:
    """Whether a dense FP8 GEMM of N × K runs a measured choice on `device`: always off CUDA (the reference path)
    and in "measure" mode (the process times it); in "table" mode when this GPU model's table has the shape. Callers
    that choose which GEMM to run (stacking projections: decode_server/model/fused_linear.py) use it so as not to
    trade tuned GEMMs for an untimed default."""
    if device.type != "cuda" or tuner().mode == "measure":
        return True
    from kernels.fp8_gemm_table import device_table

    table = device_table(torch.cuda.get_device_name(_index(device)))
    return any(key[:4] == ("dense", n, k, 0) for key in table)


def grouped_shape_tuned(n: int, k: int, experts: int, device: torch.device) -> bool:
    """`dense_shape_tuned` for a grouped FP8 GEMM of E experts' N × K weights (the MoE's choice to run gate and up
    as one [2I, H] GEMM: decode_server/model/moe.py)."""
    if device.type != "cuda" or tuner().mode == "measure":
        return True
    from kernels.fp8_gemm_table import device_table

    table = device_table(torch.cuda.get_device_name(_index(device)))
    return any(key[:4] == ("grouped", n, k, experts) for key in table)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
               block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """x [..., K] @ dequant(w [N, K])ᵀ (+ bias) → [..., N] in x's dtype."""
    k, n = x.shape[-1], w.shape[0]
    rows = x.reshape(-1, k)
    if x.is_cuda:
        choice = _TUNER.choose("dense", n, k, 0, rows.shape[0], x.dtype, x.device, [(w, w_scale)], block)
        out = _run_dense(choice, rows, w, w_scale, block, x.dtype, attached_quantized(x))
    else:
        out = fp8_linear_ref(rows, w, w_scale, block).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


def fp8_grouped_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, end_offsets: torch.Tensor,
                       block: tuple[int, int] = (128, 128), shared: SharedInput | None = None) -> torch.Tensor:
    """Rows of x [M, K] sorted by expert, expert e owning rows [end_offsets[e-1], end_offsets[e]) → [M, N] in x's
    dtype (w [E, N, K] FP8, w_scale [E, N/128, K/128]); rows past end_offsets[-1] are undefined on CUDA (zeros on
    CPU). `shared`: x as a `SharedInput`, when several GEMMs read it (quantized at most once)."""
    if not x.is_cuda:
        return fp8_grouped_ref(x, w, w_scale, end_offsets, block).to(x.dtype)
    experts, n, k = w.shape
    choice = _TUNER.choose("grouped", n, k, experts, x.shape[0], x.dtype, x.device, [(w, w_scale)], block)
    return _run_grouped(choice, x, w, w_scale, end_offsets, block, x.dtype, shared)


def fp8_batched_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor | None = None,
                       block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Per group g: x[g] [M, K] @ dequant(w[g] [N, K])ᵀ → out[g] [M, N] (G groups: MLA's heads). x, w and `out`
    may be strided views (contiguous last dims); `out` (default: a new [G, M, N] tensor in x's dtype) is written
    in place and returned. On CUDA the batched Triton kernel (quantizing x inside) with the tuned configuration of
    (N, K, G, M bucket); elsewhere the reference."""
    groups, m, k = x.shape
    n = w.shape[1]
    if out is None:
        out = torch.empty(groups, m, n, dtype=x.dtype, device=x.device)
    if not x.is_cuda:
        return out.copy_(fp8_bmm_ref(x, w, w_scale, block))
    choice = _TUNER.choose("batched", n, k, groups, m, x.dtype, x.device, [(w, w_scale)], block)
    return _run_batched(choice, x, w, w_scale, out, block)


def tune(kind: str, weights: Weights, m: int, dtype: torch.dtype, block: tuple[int, int] = (128, 128),
         routing: Routing | None = None) -> GemmChoice:
    """Decide the backend of one shape at one M (the engine's warm-up); `weights` are every weight of that shape
    (the timing rotates over them); `routing`: a grouped GEMM's decode routing (`grouped_routing_samples`)."""
    w = weights[0][0]
    if kind in ("grouped", "batched"):
        experts, n, k = w.shape
    else:
        experts, (n, k) = 0, w.shape
    return _TUNER.choose(kind, n, k, experts, m, dtype, w.device, weights, block, routing)
