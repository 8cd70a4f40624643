"""Lightning-indexer top-k on the GPU: scores at memory speed (Triton), then the exact top-k kernel (CUDA radix
select, kernels/topk_cuda.py; the Triton one for rows beyond its width).

`indexer_topk_fast` is what the engine runs on CUDA (kernels/indexer_gpu.py); both HiSparse and dense call it,
so their selections are bit-identical. Semantics: kernels/indexer_ref.py (scores) and kernels/topk_ref.py (the
selection rule and output order: ascending positions, ties to the lower position, −1 pads).

Scores kernel (`indexer_scores_fast`), one program per (query, span of position blocks), built for memory-level
parallelism (docs/kernels.md "Scores kernel"):
- The main loop's key loads are the ones the software pipeliner makes asynchronous: the block's row ids and,
  through them, the 128-byte FP8 key rows (cp.async into shared memory, `num_stages` 5 gives two key tiles in
  flight per program besides the one being multiplied).
- One tensor-core dot per block of BLOCK_N keys (keys as M, the query's heads as N, K = 128), fp32 accumulation;
  the precision of q's operand is a launch option (`precision`):
    "fp8"    — the default: q in e4m3 as DeepSeek's own indexer computes it (per-head power-of-two scale, max |q|
               ∈ [128, 256), round to nearest even, magnitudes below 2^−6 flushed to zero), FP8 × FP8 MMA: half
               the MMA work of "fp16" and no key conversion, at a score error of ~3e-2 of the query's largest
               score (top-k sets ~97.5 % equal to the exact ones). At HBM speed an fp16 dot of 64 heads does not
               fit in an SM's time per block on the H200 (docs/kernels.md).
    "fp16"   — q in one fp16 part (each head scaled by a power of two so that max |q| ∈ [256, 512), the weight
               divided by it: ReLU(2^s·x) = 2^s·ReLU(x), same score); keys e4m3 → fp16 in registers (exact).
               Score error ≈ 2–3e-4 of the query's largest score (q rounded to 11 bits).
    "fp16x2" — q = fp16 hi + lo (≈ 22 bits), two dots: the previous kernel's precision (error < 1e-6).
  q may also come already in e4m3 (`quantize_query`, one kernel the model runs where it scales the head weights;
  docs/kernels.md "The query in e4m3"): the same operand and weights as "fp8" computes per program, so the same
  score bits, without each of a query's programs loading its fp32 q (32 KB at 64 heads) and re-quantizing it.
  ReLU, the weighted head sum, × the keys' scales and the store of the block's scores follow. The next block's
  row ids and scales are loaded one iteration ahead: they feed no dot, so those loads stay synchronous, and
  issued early their latency hides behind the current block.
- One wave: spans per query = resident programs per SM (from the compiled kernel) × SMs / queries.
- Positions >= seq_len are neither read nor written (the top-k never reads them); spans wholly beyond seq_len
  return at once, so a CUDA-graph batch padded to a wide token table costs little.
- Early start (`tables_ready`, Hopper and later): launched as a programmatic dependent of the kernel before it —
  in the engine the index-key write (`write_index_rows`, which lets its dependents launch as it starts) — each
  program reads its request, length and first row ids and asks the L2 for its first key rows while that kernel
  still runs, then waits for it (griddepcontrol.wait) before q, the scales and the keys. Only for callers whose
  token tables, request ids and lengths were written before the kernel launched just before (the engine fills
  them in begin_forward): those are the loads made before the wait. Same loop after the wait, so same bits
  (H200, B 16 / 32K: the scores' cost after the write 24.2 → 22.6 µs; docs/kernels.md).
No host sync; the launch shape depends only on T, L, the SM count and the compiled kernel's occupancy; BLOCK_N is
fixed, so a query's scores never depend on the rest of the batch or the grid.

Balanced split (`FastScoresConfig(balanced=True)`, the default; e4m3 q, at most BALANCED_MAX_QUERIES queries):
the per-query kernel sizes every query's spans for the longest row, so in a batch of mixed lengths the short
rows' programs end at once and the SMs run under-filled (H200, B 64, lengths uniform in [L/8, L]: 55-56 % of the
copy's rate at 32K and 128K). `_scores_balanced_kernel` runs one wave of programs that each make the same split
from the lengths (a prefix sum of the block counts) and take an even share of the batch's blocks in query order,
a share crossing from one query into the next where it must; per query the same loop, so the same bits. After
the key write, early-started (H200): 81 % at 32K and 91 % at 128K there (B 64, 32K: 69.5 -> 48.3 us); equal
lengths within 3 % of the per-query kernel (B 16, 32K: 23.1 vs 22.5 us; B 64: 79.9 both; docs/kernels.md
"Balanced split"). Its early start reads the lengths and the first query's request and row ids before
griddepcontrol.wait. Larger batches (or a float q) take the per-query kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.topk_cuda import topk_positions
from kernels.topk_triton import candidate_capacity

INDEX_HEAD_DIM = 128
PRECISIONS = ("fp16", "fp16x2", "fp8")
_PRECISION_CODE = {"fp16": 0, "fp16x2": 1, "fp8": 2}
# Largest |score − exact score| / max |exact score| of a query, per precision: about 3× what a float64 emulation
# of the rounding gives on random data (3.2e-4, 8e-8 and 4.1e-2 for 8–64 heads), with room for the fp32 (fp8:
# Hopper's reduced-precision) accumulation. The GPU tests hold the kernel to it.
SCORE_ERROR_BOUND = {"fp16": 1e-3, "fp16x2": 5e-6, "fp8": 0.12}
QUERY_HEADS_BLOCK = 16  # heads per program of `quantize_query`
# Bound on the bytes one chunk of queries materializes (fp32 scores + the top-k's candidate scratch): 512 MiB.
MAX_CHUNK_BYTES = 512 << 20
# Most queries whose lengths every program of the balanced kernel sums (a prefix sum over BLOCK_T entries).
BALANCED_MAX_QUERIES = 1024


@dataclass(frozen=True)
class FastScoresConfig:
    """Launch shape of the scores kernel. block_n must stay fixed across batches (module docstring)."""

    precision: str = "fp8"
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 5
    blocks_per_program: int | None = None  # None: chosen from the batch shape, the SM count and the occupancy
    programs_per_sm: int | None = None  # resident programs per SM of the span rule; None: the compiled kernel's
    # Decode batches (e4m3 q, <= BALANCED_MAX_QUERIES queries) through `_scores_balanced_kernel`: the batch's blocks
    # split evenly over the grid (module docstring); the default since 2026-11-28 (H200, docs/kernels.md).
    balanced: bool = True
    # The balanced kernel's register cap a thread (Triton's maxnreg; None: none). 128 keeps its early-started form
    # at 4 programs an SM (131 registers uncapped: 3), no spill; at 96 (5 an SM, no spill) it runs 3-23 % slower (H200).
    max_registers: int | None = 128

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")


DEFAULT_CONFIG = FastScoresConfig()


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Programs of one compiled variant that fit on an SM at once, keyed by (config, HEADS_P, e4m3 q, early start,
# device index); filled from the compiled kernel's registers and shared memory after its first launch.
_RESIDENT: dict[tuple, int] = {}
_RESIDENT_GUESS = 4  # before the first launch (the measured value of the default on Hopper)


def _resident_programs(kernel: object, num_warps: int, device_index: int) -> int:
    """Occupancy of a compiled Triton kernel: programs per SM allowed by registers, shared memory and warps."""
    props = torch.cuda.get_device_properties(device_index)
    regs_per_warp = -(-int(getattr(kernel, "n_regs", 0)) * 32 // 256) * 256  # allocated per warp, 256 at a time
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // max(1, regs_per_warp * num_warps)
    smem = int(getattr(kernel.metadata, "shared", 0)) + 1024  # + the 1 KB the driver reserves per block
    by_smem = getattr(props, "shared_memory_per_multiprocessor", 233472) // smem
    by_warps = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * num_warps)
    return max(1, min(by_regs, by_smem, by_warps, 32))


def blocks_per_program(num_q: int, max_len: int, block_n: int, device: torch.device,
                       resident_per_sm: int = _RESIDENT_GUESS) -> int:
    """Position blocks per program: the fewest programs that still fill every resident slot of the GPU once, so
    all of them run in one wave (no tail) and each pipeline runs as long as it can."""
    blocks = triton.cdiv(max_len, block_n)
    if device.type != "cuda":  # the Triton interpreter (tests on CPU)
        return max(1, min(4, blocks))
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    spans = max(1, (resident_per_sm * sms) // max(1, num_q))
    return triton.cdiv(blocks, spans)


@functools.cache
def _early_start_supported(device_index: int) -> bool:
    """Programmatic dependent launch (griddepcontrol) needs compute capability 9.0."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@triton.jit
def _prefetch_l2(ptrs):
    """Ask the L2 for the 32-byte sectors at `ptrs` (no data into registers: safe before griddepcontrol.wait, a
    line the kernel before changes meanwhile is read fresh from the L2 after the wait)."""
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _write_index_rows_kernel(keys_ptr, scales_ptr, rows_ptr, dst_keys_ptr, dst_scales_ptr, stride_src, stride_dst,
                             num, LET_NEXT_START: tl.constexpr, BLOCK_T: tl.constexpr):
    """BLOCK_T tokens a program: key row t → dst row rows[t], its scale likewise. LET_NEXT_START: a programmatic
    dependent launched after this kernel (the scores kernel) may start now; it waits for this kernel's writes
    before it reads the keys or scales."""
    if LET_NEXT_START:
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    dims = tl.arange(0, 128)  # INDEX_HEAD_DIM
    row = tl.load(rows_ptr + t, mask=t < num, other=-1).to(tl.int64)
    ok = (t < num) & (row >= 0)
    key = tl.load(keys_ptr + t[:, None].to(tl.int64) * stride_src + dims[None, :], mask=ok[:, None], other=0)
    tl.store(dst_keys_ptr + row[:, None] * stride_dst + dims[None, :], key, mask=ok[:, None])
    scale = tl.load(scales_ptr + t, mask=ok, other=0.0).to(tl.float32)
    tl.store(dst_scales_ptr + row, scale, mask=ok)


@triton.jit
def _round_to_e4m3(x):
    """x (|x| <= 448) rounded to the nearest e4m3 value, ties to even; |x| < 2^-6 (below e4m3's normal range)
    flushed to zero. Done in fp32 bits so that the conversion that follows is exact on every backend."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep 3 mantissa bits (0xFFF00000)
    return tl.where(tl.abs(x) < 0.015625, 0.0, rounded.to(tl.float32, bitcast=True))


@triton.jit
def _scale_heads(q, w, PRECISION: tl.constexpr):
    """q [HEADS_P, 128], w [HEADS_P] float32 → (q · 2^s, w · 2^-s) with one power of two 2^s per head (the score is
    unchanged: ReLU(2^s·x) = 2^s·ReLU(x)): the head's largest |q| lands in [128, 256) for e4m3 operands
    (PRECISION 2), in [256, 512) for fp16 ones."""
    exp_field = (tl.max(tl.abs(q), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF
    if PRECISION == 2:
        s = tl.minimum(tl.maximum(134 - exp_field, -60), 60)
    else:
        s = tl.minimum(tl.maximum(135 - exp_field, -60), 60)
    q = q * ((s + 127) << 23).to(tl.float32, bitcast=True)[:, None]
    w = w * ((127 - s) << 23).to(tl.float32, bitcast=True)
    return q, w


@triton.jit
def _quantize_query_kernel(q_ptr, w_ptr, q_out_ptr, w_out_ptr, stride_qt, stride_qh, stride_wt, num_heads,
                           weight_scale, HEADS_BLOCK: tl.constexpr):
    """One program per (query, block of heads): each head scaled and rounded exactly as the scores kernel's fp8
    mode does it (heads are independent, so blocks of them spread a query over several SMs)."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
    dims = tl.arange(0, 128)  # INDEX_HEAD_DIM
    head_ok = heads < num_heads
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=head_ok[:, None],
                other=0.0).to(tl.float32)
    # The product as torch's `weights * weight_scale` rounds it (float32), then the exact power of two.
    w = tl.load(w_ptr + t * stride_wt + heads, mask=head_ok, other=0.0).to(tl.float32) * weight_scale
    q, w = _scale_heads(q, w, 2)
    q8 = _round_to_e4m3(q).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(q_out_ptr + t * num_heads * 128 + heads[:, None] * 128 + dims[None, :], q8, mask=head_ok[:, None])
    tl.store(w_out_ptr + t * num_heads + heads, w, mask=head_ok)


@triton.jit
def _score_block(pos, scored_end, row_base, stride_rows_l, keys_ptr, stride_keys, scales_ptr, scale_next, q_op, q_lo,
                 w, out_base, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """One block of the scores kernels' main loop: row ids → key rows (both pipelined by the loop) → one dot →
    ReLU, the weighted head sum × the keys' scales, stored. The scales (and the row ids they need) come one block
    ahead: those loads feed no dot, so the pipeliner leaves them synchronous, and loaded in the block that uses
    them they stalled every iteration on memory. `scale_next` in: this block's scales; returned: the next one's."""
    visible = pos < scored_end
    rows = tl.load(row_base + pos * stride_rows_l, mask=visible, other=-1).to(tl.int64)
    valid = visible & (rows >= 0)
    key_scale = scale_next  # 0 where the row id is < 0 or the position is not visible
    pos_next = pos + BLOCK_N
    ahead = pos_next < scored_end
    rows_next = tl.load(row_base + pos_next * stride_rows_l, mask=ahead, other=-1).to(tl.int64)
    scale_next = tl.load(scales_ptr + rows_next, mask=ahead & (rows_next >= 0), other=0.0)
    dims = tl.arange(0, 128)  # INDEX_HEAD_DIM
    raw = tl.load(keys_ptr + rows[:, None] * stride_keys + dims[None, :], mask=valid[:, None], other=0)
    if PRECISION == 2:
        logits = tl.dot(raw.to(tl.float8e4nv, bitcast=True), q_op)  # [BLOCK_N, HEADS_P]
    else:
        keys = raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)  # exact: e4m3 ⊂ fp16
        logits = tl.dot(keys, q_op)
        if PRECISION == 1:
            logits = tl.dot(keys, q_lo, logits)
    score = tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1) * key_scale
    tl.store(out_base + pos, score, mask=visible)
    return scale_next


# Not specialized on the growing length, the span or the token table's row stride (a new compile in the middle of
# serving would cost many steps); the output's row stride is padded to a multiple of 64 instead.
@triton.jit(do_not_specialize=["max_len", "blocks_per_prog", "stride_rows_b"])
def _scores_kernel(
    q_ptr, w_ptr, keys_ptr, scales_ptr, rows_ptr, req_ptr, lens_ptr, out_ptr,
    stride_qt, stride_qh, stride_wt, stride_keys, stride_rows_b, stride_rows_l, stride_out,
    num_heads, max_len, blocks_per_prog,
    HEADS_P: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, Q_E4M3: tl.constexpr,
    EARLY: tl.constexpr = False,
):
    # EARLY (launched as a programmatic dependent): until griddepcontrol.wait only the token tables, request ids
    # and lengths are read — written before the kernel launched just before this one — and the first key rows are
    # asked into the L2; q, the weights, scales and keys are read after it (module docstring).
    t = tl.program_id(0).to(tl.int64)
    span = tl.program_id(1)
    req = tl.load(req_ptr + t).to(tl.int64)
    seq_len = tl.minimum(tl.load(lens_ptr + t).to(tl.int64), max_len).to(tl.int32)
    start = span * blocks_per_prog * BLOCK_N
    scored_end = tl.minimum(tl.minimum(start + blocks_per_prog * BLOCK_N, max_len), seq_len)
    if scored_end > start:
        heads = tl.arange(0, HEADS_P)
        dims = tl.arange(0, 128)  # INDEX_HEAD_DIM
        offs = tl.arange(0, BLOCK_N)
        head_ok = heads < num_heads
        row_base = rows_ptr + req * stride_rows_b
        pos_next = start + offs
        rows_next = tl.load(row_base + pos_next * stride_rows_l, mask=pos_next < scored_end, other=-1).to(tl.int64)
        if EARLY:
            sectors = tl.arange(0, 4) * 32  # a key row's four 32-byte sectors
            _prefetch_l2(keys_ptr + tl.maximum(rows_next, 0)[:, None] * stride_keys + sectors[None, :])
            tl.extra.cuda.gdc_wait()
        q_at = q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :]
        w = tl.load(w_ptr + t * stride_wt + heads, mask=head_ok, other=0.0).to(tl.float32)
        if Q_E4M3:  # quantized by `quantize_query` (PRECISION is 2): its bytes, w already scaled
            q_op = tl.trans(tl.load(q_at, mask=head_ok[:, None], other=0).to(tl.float8e4nv, bitcast=True))
            q_lo = q_op
        else:
            # Per-head power of two 2^s, folded into w as 2^-s.
            q, w = _scale_heads(tl.load(q_at, mask=head_ok[:, None], other=0.0).to(tl.float32), w, PRECISION)
            if PRECISION == 2:
                q_op = tl.trans(_round_to_e4m3(q).to(tl.float8e4nv))  # [128, HEADS_P], exact conversion
                q_lo = q_op
            else:
                q_hi = q.to(tl.float16)
                q_op = tl.trans(q_hi)
                q_lo = tl.trans((q - q_hi.to(tl.float32)).to(tl.float16))
        out_base = out_ptr + t * stride_out
        num_blocks = (scored_end - start + BLOCK_N - 1) // BLOCK_N
        # Main loop: row ids → key rows (both pipelined) → one dot → block scores × the keys' scales. The scales
        # (and the row ids they need) are loaded one block ahead: those loads feed no dot, so the pipeliner leaves
        # them synchronous, and loaded in the block that uses them they stalled every iteration on memory.
        scale_next = tl.load(scales_ptr + rows_next, mask=(pos_next < scored_end) & (rows_next >= 0), other=0.0)
        for i in range(0, num_blocks):
            scale_next = _score_block(start + i * BLOCK_N + offs, scored_end, row_base, stride_rows_l, keys_ptr,
                                      stride_keys, scales_ptr, scale_next, q_op, q_lo, w, out_base, BLOCK_N,
                                      PRECISION)
    elif EARLY:
        tl.extra.cuda.gdc_wait()  # every program waits: the kernel never ends before the one it depends on


# `FastScoresConfig(balanced=True)` (at most BALANCED_MAX_QUERIES queries, e4m3 q): the batch's position blocks
# split evenly over a fixed grid (module docstring, "Balanced split"). Not specialized on the lengths or width.
@triton.jit(do_not_specialize=["max_len", "stride_rows_b"])
def _scores_balanced_kernel(
    q_ptr, w_ptr, keys_ptr, scales_ptr, rows_ptr, req_ptr, lens_ptr, out_ptr,
    stride_qt, stride_qh, stride_wt, stride_keys, stride_rows_b, stride_rows_l, stride_out,
    num_q, num_heads, max_len,
    HEADS_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, EARLY: tl.constexpr = False,
):
    # Every program makes the same split from the lengths (a prefix sum over the queries' block counts) and takes
    # blocks [p·G/P, (p+1)·G/P) of the G blocks in query order: one or more segments, each a query's consecutive
    # blocks, scored by the per-query kernel's loop (same per-position work, so the same bits). EARLY: as in
    # `_scores_kernel`, only the lengths, request ids and row ids are read before griddepcontrol.wait.
    p = tl.program_id(0).to(tl.int64)
    programs = tl.num_programs(0).to(tl.int64)
    qi = tl.arange(0, BLOCK_T)
    lens = tl.minimum(tl.load(lens_ptr + qi, mask=qi < num_q, other=0).to(tl.int64), max_len)
    ends = tl.cumsum((lens + BLOCK_N - 1) // BLOCK_N, axis=0)  # inclusive prefix of the block counts
    total = tl.max(ends, axis=0)
    g0 = p * total // programs
    g1 = (p + 1) * total // programs
    t = tl.sum((ends <= g0).to(tl.int64), axis=0)  # the query holding block g0 (the first with end > g0)
    b = (g0 - tl.max(tl.where(ends <= g0, ends, 0), axis=0)).to(tl.int32)
    remaining = (g1 - g0).to(tl.int32)
    segments = tl.where(remaining > 0, tl.sum((ends <= g1 - 1).to(tl.int64), axis=0) - t + 1, 0).to(tl.int32)
    heads = tl.arange(0, HEADS_P)
    dims = tl.arange(0, 128)  # INDEX_HEAD_DIM
    offs = tl.arange(0, BLOCK_N)
    head_ok = heads < num_heads
    if EARLY:
        if remaining > 0:
            first_req = tl.load(req_ptr + t).to(tl.int64)
            first_pos = b * BLOCK_N + offs
            first_len = tl.minimum(tl.load(lens_ptr + t).to(tl.int64), max_len)
            first_rows = tl.load(rows_ptr + first_req * stride_rows_b + first_pos * stride_rows_l,
                                 mask=first_pos < first_len, other=-1).to(tl.int64)
            sectors = tl.arange(0, 4) * 32  # a key row's four 32-byte sectors
            _prefetch_l2(keys_ptr + tl.maximum(first_rows, 0)[:, None] * stride_keys + sectors[None, :])
        tl.extra.cuda.gdc_wait()  # every program waits: the kernel never ends before the one it depends on
    for _segment in range(0, segments):
        req = tl.load(req_ptr + t).to(tl.int64)
        seq_len = tl.minimum(tl.load(lens_ptr + t).to(tl.int64), max_len).to(tl.int32)
        num_blocks = tl.minimum((seq_len + BLOCK_N - 1) // BLOCK_N - b, remaining)
        start = b * BLOCK_N
        scored_end = tl.minimum(start + num_blocks * BLOCK_N, seq_len)
        row_base = rows_ptr + req * stride_rows_b
        pos_next = start + offs
        rows_next = tl.load(row_base + pos_next * stride_rows_l, mask=pos_next < scored_end, other=-1).to(tl.int64)
        q_at = q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :]
        w = tl.load(w_ptr + t * stride_wt + heads, mask=head_ok, other=0.0).to(tl.float32)
        q_op = tl.trans(tl.load(q_at, mask=head_ok[:, None], other=0).to(tl.float8e4nv, bitcast=True))
        out_base = out_ptr + t * stride_out
        scale_next = tl.load(scales_ptr + rows_next, mask=(pos_next < scored_end) & (rows_next >= 0), other=0.0)
        for i in range(0, num_blocks):  # `_scores_kernel`'s main loop (e4m3 q)
            scale_next = _score_block(start + i * BLOCK_N + offs, scored_end, row_base, stride_rows_l, keys_ptr,
                                      stride_keys, scales_ptr, scale_next, q_op, q_op, w, out_base, BLOCK_N, 2)
        remaining -= num_blocks
        t += 1
        b = b * 0  # the next segment starts at its query's first block


def indexer_scores_fast(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys_fp8: torch.Tensor,
    scales: torch.Tensor,
    token_rows: torch.Tensor,
    token_req: torch.Tensor,
    seq_lens: torch.Tensor,
    config: FastScoresConfig | None = None,
    tables_ready: bool = False,
) -> torch.Tensor:
    """fp32 scores [T, L] (L = token_rows.shape[1]); positions >= seq_len are left unwritten. Arguments as in
    kernels/indexer_ref.py; q and weights may be any float dtype (computed in fp32), or q float8_e4m3fn with the
    weights that `quantize_query` returned with it (then the dot is FP8 × FP8 whatever `config.precision`).
    tables_ready: token_rows, token_req and seq_lens were written before the kernel launched just before this
    call, so the kernel may start early and read them while that kernel runs (module docstring; Hopper and
    later, ignored elsewhere). Same scores either way."""
    cfg = config or DEFAULT_CONFIG
    q_e4m3 = q.dtype == torch.float8_e4m3fn
    num_q, heads, dim = q.shape
    if dim != INDEX_HEAD_DIM:
        raise ValueError(f"indexer head dim must be {INDEX_HEAD_DIM}, got {dim}")
    if keys_fp8.dim() != 2 or keys_fp8.shape[1] != INDEX_HEAD_DIM or keys_fp8.stride(1) != 1:
        raise ValueError(f"keys_fp8 must be [N, {INDEX_HEAD_DIM}] with unit inner stride")
    max_len = token_rows.shape[1]
    # Row stride padded to a multiple of 64 elements: always the same alignment, so one compiled variant.
    padded = triton.cdiv(max(max_len, 1), 64) * 64
    out = torch.empty((num_q, padded), dtype=torch.float32, device=q.device)[:, :max_len]
    if num_q == 0 or max_len == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    weights = weights if weights.stride(1) == 1 else weights.contiguous()
    scales = scales.contiguous()
    heads_p = max(16, triton.next_power_of_2(heads))
    device_index = q.device.index if q.device.index is not None else 0
    early = tables_ready and q.is_cuda and _early_start_supported(device_index)
    if q_e4m3 and cfg.balanced and cfg.blocks_per_program is None and num_q <= BALANCED_MAX_QUERIES:
        _scores_balanced(q, weights, keys_fp8, scales, token_rows, token_req, seq_lens, out, cfg, heads_p, early,
                         device_index)
        return out
    resident_key = (cfg, heads_p, q_e4m3, early, device_index)
    resident = cfg.programs_per_sm or _RESIDENT.get(resident_key, _RESIDENT_GUESS)
    per_prog = cfg.blocks_per_program or blocks_per_program(num_q, max_len, cfg.block_n, q.device, resident)
    grid = (num_q, triton.cdiv(max_len, per_prog * cfg.block_n))
    kernel = _scores_kernel[grid](
        q.view(torch.uint8) if q_e4m3 else q, weights, keys_fp8.view(torch.uint8), scales, token_rows, token_req,
        seq_lens, out,
        q.stride(0), q.stride(1), weights.stride(0), keys_fp8.stride(0), token_rows.stride(0),
        token_rows.stride(1), out.stride(0),
        heads, max_len, per_prog,
        HEADS_P=heads_p, BLOCK_N=cfg.block_n, PRECISION=_PRECISION_CODE["fp8" if q_e4m3 else cfg.precision],
        Q_E4M3=q_e4m3, EARLY=early, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"launch_pdl": True} if early else {}),
    )
    if q.is_cuda and resident_key not in _RESIDENT and hasattr(kernel, "metadata"):
        _RESIDENT[resident_key] = _resident_programs(kernel, cfg.num_warps, device_index)
    return out



def _scores_balanced(q: torch.Tensor, weights: torch.Tensor, keys_fp8: torch.Tensor, scales: torch.Tensor,
                     token_rows: torch.Tensor, token_req: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                     cfg: FastScoresConfig, heads_p: int, early: bool, device_index: int) -> None:
    """`_scores_balanced_kernel` on a grid of resident programs per SM × SMs (one wave; the split, not the grid,
    decides which program scores a block, and the bits do not depend on either)."""
    num_q, heads, _ = q.shape
    resident_key = ("balanced", cfg, heads_p, early, device_index)
    resident = cfg.programs_per_sm or _RESIDENT.get(resident_key, _RESIDENT_GUESS)
    sms = _sm_count(device_index) if q.is_cuda else 1  # the Triton interpreter (CPU tests): a few programs
    kernel = _scores_balanced_kernel[(resident * sms,)](
        q.view(torch.uint8), weights, keys_fp8.view(torch.uint8), scales, token_rows, token_req, seq_lens, out,
        q.stride(0), q.stride(1), weights.stride(0), keys_fp8.stride(0), token_rows.stride(0), token_rows.stride(1),
        out.stride(0),
        num_q, heads, token_rows.shape[1],
        HEADS_P=heads_p, BLOCK_N=cfg.block_n, BLOCK_T=max(16, triton.next_power_of_2(num_q)), EARLY=early,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"launch_pdl": True} if early else {}),
        **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}),
    )
    if q.is_cuda and resident_key not in _RESIDENT and hasattr(kernel, "metadata"):
        _RESIDENT[resident_key] = _resident_programs(kernel, cfg.num_warps, device_index)


def takes_e4m3_query(config: FastScoresConfig | None = None) -> bool:
    """Whether the scores kernel runs its FP8 dot under `config` (default: `DEFAULT_CONFIG`, read now), so that
    a query quantized beforehand by `quantize_query` gives the scores it would compute itself."""
    return (config or DEFAULT_CONFIG).precision == "fp8"


def quantize_query(q: torch.Tensor, weights: torch.Tensor, weight_scale: float = 1.0
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, 128] and weights [T, H] (float32) → (q in float8_e4m3fn [T, H, 128], weights [T, H] float32): each
    head scaled by its power of two and rounded as the fp8 scores kernel does it, the weights multiplied by
    weight_scale (in float32, as `weights * weight_scale` rounds) and by the inverse power of two. One program per
    query and QUERY_HEADS_BLOCK heads (a single query's 32 KB from one SM was latency-bound), so batch invariant.
    `indexer_scores_fast` on the result gives the bits it gives on (q, weights · weight_scale) in fp8 precision
    (the GPU tests hold it to that); `kernels.indexer_ref` reads the same pair."""
    num_q, heads, dim = q.shape
    if dim != INDEX_HEAD_DIM or weights.shape != (num_q, heads):
        raise ValueError(f"q must be [T, H, {INDEX_HEAD_DIM}] and weights [T, H], got {tuple(q.shape)} and "
                         f"{tuple(weights.shape)}")
    q_out = torch.empty((num_q, heads, dim), dtype=torch.float8_e4m3fn, device=q.device)
    w_out = torch.empty((num_q, heads), dtype=torch.float32, device=q.device)
    if num_q == 0:
        return q_out, w_out
    if q.stride(2) != 1:
        q = q.contiguous()
    weights = weights if weights.stride(1) == 1 else weights.contiguous()
    heads_block = min(QUERY_HEADS_BLOCK, triton.next_power_of_2(heads))
    _quantize_query_kernel[(num_q, triton.cdiv(heads, heads_block))](
        q, weights, q_out.view(torch.uint8), w_out, q.stride(0), q.stride(1), weights.stride(0), heads,
        float(weight_scale), HEADS_BLOCK=heads_block, num_warps=4,
    )
    return q_out, w_out


def write_index_rows(keys_dst: torch.Tensor, scales_dst: torch.Tensor, rows: torch.Tensor, keys_fp8: torch.Tensor,
                     scales: torch.Tensor) -> None:
    """keys_dst[rows] = keys_fp8, scales_dst[rows] = scales (as float32) in one kernel: the index-key write that
    precedes a layer's scores (two indexed assignments took ~7 µs of a replayed graph, this ~2 µs; H200). It
    lets a programmatic dependent launched after it start at once (`indexer_scores_fast(tables_ready=True)`).
    keys_dst [N, 128] e4m3 rows with unit inner stride, scales_dst [N] float32 contiguous, rows [T] (rows < 0
    skipped), keys_fp8 [T, 128] e4m3, scales [T]."""
    num = rows.shape[0]
    if keys_fp8.shape != (num, INDEX_HEAD_DIM) or scales.shape != (num,):
        raise ValueError(f"expected keys [{num}, {INDEX_HEAD_DIM}] and scales [{num}], got {tuple(keys_fp8.shape)} "
                         f"and {tuple(scales.shape)}")
    if keys_dst.dim() != 2 or keys_dst.shape[1] != INDEX_HEAD_DIM or keys_dst.stride(1) != 1:
        raise ValueError(f"keys_dst must be [N, {INDEX_HEAD_DIM}] with unit inner stride")
    if scales_dst.dtype != torch.float32 or scales_dst.dim() != 1 or scales_dst.stride(0) != 1:
        raise ValueError("scales_dst must be a contiguous float32 vector")
    if num == 0:
        return
    keys_fp8 = keys_fp8 if keys_fp8.stride(1) == 1 else keys_fp8.contiguous()
    scales = scales.contiguous()
    block_t = 16
    let_next_start = keys_dst.is_cuda and _early_start_supported(
        keys_dst.device.index if keys_dst.device.index is not None else torch.cuda.current_device())
    _write_index_rows_kernel[(triton.cdiv(num, block_t),)](
        keys_fp8.view(torch.uint8), scales, rows, keys_dst.view(torch.uint8), scales_dst, keys_fp8.stride(0),
        keys_dst.stride(0), num, LET_NEXT_START=let_next_start, BLOCK_T=block_t, num_warps=4,
    )


def short_rows_topk(seq_lens: torch.Tensor, top_k: int, device: torch.device) -> torch.Tensor:
    """[T, top_k] int32: 0..n−1 then −1 (what every query with n <= top_k visible positions selects)."""
    seq = seq_lens.to(device=device, dtype=torch.int64)
    ar = torch.arange(top_k, device=device, dtype=torch.int64)
    return torch.where(ar.unsqueeze(0) < seq.unsqueeze(1), ar.unsqueeze(0), -1).to(torch.int32)


def queries_per_chunk(max_len: int, top_k: int) -> int:
    """Queries scored and selected at once: their fp32 scores and the top-k's scratch stay under
    MAX_CHUNK_BYTES."""
    per_query = 4 * max_len + 8 * candidate_capacity(top_k)
    return max(1, MAX_CHUNK_BYTES // per_query)


def indexer_topk_fast(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys_fp8: torch.Tensor,
    scales: torch.Tensor,
    token_rows: torch.Tensor,
    token_req: torch.Tensor,
    seq_lens: torch.Tensor,
    top_k: int,
    config: FastScoresConfig | None = None,
    tables_ready: bool = False,
) -> torch.Tensor:
    """[T, top_k] int32 positions, ascending, −1 pads (rule: kernels/topk_ref.py). No host sync: the launch
    shapes depend on T, L = token_rows.shape[1] and top_k only. tables_ready: as in `indexer_scores_fast` (the
    engine: the index-key write runs right before)."""
    num_q = q.shape[0]
    max_len = token_rows.shape[1]
    device = q.device
    if num_q == 0 or max_len <= top_k:
        return short_rows_topk(seq_lens, top_k, device)  # every request fits: dense over 0..n−1
    req = token_req.to(device=device, dtype=torch.int64)
    seq = seq_lens.to(device=device, dtype=torch.int64)
    # A conversion just made is a kernel right before the scores that wrote what they would read early.
    tables_ready = tables_ready and req is token_req and seq is seq_lens
    chunk = queries_per_chunk(max_len, top_k)
    if num_q <= chunk:
        scores = indexer_scores_fast(q, weights, keys_fp8, scales, token_rows, req, seq, config, tables_ready)
        return topk_positions(scores, seq, top_k)
    picked = torch.empty((num_q, top_k), dtype=torch.int32, device=device)
    for start in range(0, num_q, chunk):
        end = min(num_q, start + chunk)
        scores = indexer_scores_fast(q[start:end], weights[start:end], keys_fp8, scales, token_rows,
                                     req[start:end], seq[start:end], config, tables_ready)
        picked[start:end] = topk_positions(scores, seq[start:end], top_k)
    return picked
