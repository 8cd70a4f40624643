"""Top-k of the indexer scores on the GPU (Triton): exact, deterministic, per-row lengths, no host sync.

The engine runs the CUDA kernel (kernels/topk_cuda.py, 4–6× faster: docs/benchmarks.md); this one serves rows wider
than that kernel's shared-memory bitmap and the CPU checks under Triton's interpreter. A threshold search by
four 256-bin `tl.histogram`s (instead of 32 counts) was tried and measured slower on an H200 (92 against 72 µs a
row at 32K), and removed.

Same rule and output as kernels/topk_ref.py (`topk_positions_ref`): the k visible positions with the largest
(order key, −position), in ascending position order; rows with n <= k visible positions give 0..n−1 then −1.

One program per row (16 warps). A threshold selection in the spirit of a radix select (SGLang's fast top-k for
DSA): find the k-th largest key T, then take every position with key > T and the first k − #(key > T)
positions with key == T, in position order. Steps for a row of n > k visible scores:

1. Threshold estimate (rows longer than CAPACITY only): a fixed sample of SAMPLE_CHUNKS runs of SAMPLE_CHUNK
   consecutive scores spread evenly over [0, n) (coalesced reads); t_lo = the sample's key of rank
   ⌈target · |sample| / n⌉, target = (k + CAPACITY) / 2, so that #(key >= t_lo) is expected midway between k and
   CAPACITY (for k = 2048, n = 128K: ~7 standard deviations from either bound). Rows of at most CAPACITY
   scores use t_lo = the smallest key: every position is a candidate.
2. One pass over the row: counts #(key >= t_lo) and #(key > t_lo), and writes the candidates (key >= t_lo),
   in position order, to a per-row scratch area (a block prefix sum gives each candidate its slot).
3. Fast path, k <= #candidates <= CAPACITY (all random-data rows): the candidates are loaded as one register
   tensor; T = the largest t with #(key >= t) >= k, found bit by bit (32 block-wide counts; exact for any key
   distribution); then one prefix sum of the `key == T` flags ranks the ties and one prefix sum of the selected
   flags gives each selected position its output slot. No sort: the slots follow position order.
4. Otherwise (the estimate missed, or a tie run wider than CAPACITY straddles the threshold):
   - if #(key > t_lo) < k <= #(key >= t_lo), T = t_lo exactly (e.g. an all-equal row);
   - else T is found bit by bit with full-row counting passes (32 passes over the row: slow, but only rows
     whose sample lied take it);
   then one full-row pass selects and writes in position order as in step 3.
The result never depends on which path ran (each finds the same T); only the time does. `paths` (optional output)
records the path per row for tests and benchmarks: 0 short row, 1 fast, 2 threshold = estimate, 3 full search.

Memory: the scores are read once in step 2 (plus the sample); the scratch area (2 · CAPACITY int32 per row) is
written once and read once, in L2. Everything is sized by shapes only (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Candidate capacity of the fast path (a power of two, >= 4·k keeps both failure bounds far away).
CAPACITY_MIN = 8192
SAMPLE_CHUNKS = 128
SAMPLE_CHUNK = 32
SCAN_BLOCK = 4096
SCAN_STAGES = 3  # scan loops keep this many blocks of scores in flight (async copies)
NUM_WARPS = 16
PATH_SHORT, PATH_FAST, PATH_ESTIMATE_EXACT, PATH_FULL_SEARCH = 0, 1, 2, 3


def candidate_capacity(top_k: int) -> int:
    return max(CAPACITY_MIN, 4 * triton.next_power_of_2(top_k))


def sample_positions(n: int) -> list[int]:
    """Positions the kernel samples in a row of n > CAPACITY visible scores (for tests that build rows on which
    the estimate must miss)."""
    return [(c * (n - SAMPLE_CHUNK)) // (SAMPLE_CHUNKS - 1) + i for c in range(SAMPLE_CHUNKS)
            for i in range(SAMPLE_CHUNK)]


def sample_rank(n: int, top_k: int) -> int:
    """Rank (1 = largest) of the sample key used as t_lo (mirror of the kernel's formula)."""
    size = SAMPLE_CHUNKS * SAMPLE_CHUNK
    target = (top_k + candidate_capacity(top_k)) // 2
    return min(max((target * size + n - 1) // n, 1), size)


@triton.jit
def _order_key(x):
    """float32 → int32 with the float order; −0.0 → +0.0's key; NaN → the largest key (kernels/topk_ref.py)."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where(bits == -2147483648, 0, key)
    return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FFFFFFF, key)


@triton.jit
def _kth_key(keys, valid, rank):
    """The largest t with #(valid & keys >= t) >= rank (1 <= rank <= #valid), bit by bit from the sign."""
    nonneg = tl.sum((valid & (keys >= 0)).to(tl.int32), axis=0)
    t = tl.where(nonneg >= rank, 0, -2147483648)
    for b in tl.static_range(30, -1, -1):
        cand = t | (1 << b)
        count = tl.sum((valid & (keys >= cand)).to(tl.int32), axis=0)
        t = tl.where(count >= rank, cand, t)
    return t


@triton.jit
def _count_row(s_row, n, t, GREATER: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """#(key >= t) (or #(key > t) with GREATER) over the first n scores of a row."""
    offs = tl.arange(0, BLOCK)
    count = n * 0
    for start in tl.range(0, n, BLOCK, num_stages=STAGES):
        pos = start + offs
        inside = pos < n
        key = _order_key(tl.load(s_row + pos, mask=inside, other=0.0))
        hit = inside & (key > t) if GREATER else inside & (key >= t)
        count += tl.sum(hit.to(tl.int32), axis=0)
    return count


@triton.jit
def _kth_key_row(s_row, n, rank, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """`_kth_key` over a whole row, one counting pass per bit (the slow path)."""
    nonneg = _count_row(s_row, n, 0, False, BLOCK, STAGES)
    t = tl.where(nonneg >= rank, 0, -2147483648)
    for b in range(30, -1, -1):
        cand = t | (1 << b)
        count = _count_row(s_row, n, cand, False, BLOCK, STAGES)
        t = tl.where(count >= rank, cand, t)
    return t


@triton.jit(do_not_specialize=["width"])
def _topk_kernel(
    scores_ptr, lens_ptr, out_ptr, cand_key_ptr, cand_pos_ptr, paths_ptr,
    stride_s, stride_o, stride_c, width, top_k,
    CAPACITY: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, CHUNK: tl.constexpr,
    STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.maximum(tl.load(lens_ptr + row), 0), width).to(tl.int32)
    s_row = scores_ptr + row * stride_s
    o_row = out_ptr + row * stride_o
    ck_row = cand_key_ptr + row * stride_c
    cp_row = cand_pos_ptr + row * stride_c
    offs = tl.arange(0, BLOCK)
    path = n * 0
    if n <= top_k:
        for start in range(0, top_k, BLOCK):
            idx = start + offs
            tl.store(o_row + idx, tl.where(idx < n, idx, -1), mask=idx < top_k)
    else:
        # 1. Threshold estimate from a fixed sample (all positions are candidates in rows <= CAPACITY).
        t_lo = n * 0 + (-2147483648)
        if n > CAPACITY:
            sidx = tl.arange(0, CHUNKS * CHUNK)
            spos = ((sidx // CHUNK) * (n - CHUNK)) // (CHUNKS - 1) + sidx % CHUNK
            skeys = _order_key(tl.load(s_row + spos))
            target = (top_k + CAPACITY) // 2
            rank = tl.minimum(tl.maximum((target * (CHUNKS * CHUNK) + n - 1) // n, 1), CHUNKS * CHUNK)
            t_lo = _kth_key(skeys, sidx >= 0, rank)
        # 2. Count and compact the candidates (key >= t_lo) in position order.
        n_ge = n * 0
        n_gt = n * 0
        for start in tl.range(0, n, BLOCK, num_stages=STAGES):
            pos = start + offs
            inside = pos < n
            key = _order_key(tl.load(s_row + pos, mask=inside, other=0.0))
            ge = (inside & (key >= t_lo)).to(tl.int32)
            slot = n_ge + tl.cumsum(ge, axis=0) - 1
            keep = (ge > 0) & (slot < CAPACITY)
            tl.store(ck_row + slot, key, mask=keep)
            tl.store(cp_row + slot, pos, mask=keep)
            n_ge += tl.sum(ge, axis=0)
            n_gt += tl.sum((inside & (key > t_lo)).to(tl.int32), axis=0)
        if (n_ge >= top_k) & (n_ge <= CAPACITY):
            # 3. Fast path: exact threshold among the candidates, ties ranked by position, slots by prefix sum.
            tl.debug_barrier()  # the candidates were written by other threads of this program
            cidx = tl.arange(0, CAPACITY)
            valid = cidx < n_ge
            keys = tl.load(ck_row + cidx, mask=valid, other=-2147483648, cache_modifier=".cg")
            cpos = tl.load(cp_row + cidx, mask=valid, other=0, cache_modifier=".cg")
            t = _kth_key(keys, valid, top_k)
            above = valid & (keys > t)
            ties_wanted = top_k - tl.sum(above.to(tl.int32), axis=0)
            tie = (valid & (keys == t)).to(tl.int32)
            tie_rank = tl.cumsum(tie, axis=0) - tie
            sel = (above | ((tie > 0) & (tie_rank < ties_wanted))).to(tl.int32)
            out_slot = tl.cumsum(sel, axis=0) - sel
            tl.store(o_row + out_slot, cpos, mask=sel > 0)
            path = n * 0 + 1
        else:
            # 4. Slow paths: exact threshold from the estimate or from a full-row search, then a full-row pass.
            t = t_lo
            n_above = n_gt
            path = n * 0 + 2
            if (n_gt >= top_k) | (n_ge < top_k):
                t = _kth_key_row(s_row, n, top_k, BLOCK, STAGES)
                n_above = _count_row(s_row, n, t, True, BLOCK, STAGES)
                path = n * 0 + 3
            ties_wanted = top_k - n_above
            ties_seen = n * 0
            written = n * 0
            for start in tl.range(0, n, BLOCK, num_stages=STAGES):
                pos = start + offs
                inside = pos < n
                key = _order_key(tl.load(s_row + pos, mask=inside, other=0.0))
                tie = (inside & (key == t)).to(tl.int32)
                tie_rank = ties_seen + tl.cumsum(tie, axis=0) - tie
                sel = ((inside & (key > t)) | ((tie > 0) & (tie_rank < ties_wanted))).to(tl.int32)
                out_slot = written + tl.cumsum(sel, axis=0) - sel
                tl.store(o_row + out_slot, pos, mask=sel > 0)
                ties_seen += tl.sum(tie, axis=0)
                written += tl.sum(sel, axis=0)
    tl.store(paths_ptr + row, path)


def topk_positions_triton(
    scores: torch.Tensor, seq_lens: torch.Tensor, top_k: int, *, return_paths: bool = False,
    num_warps: int = NUM_WARPS, scan_block: int = SCAN_BLOCK,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """scores [T, L] float32 on the GPU (unit inner stride; positions >= seq_len are never read), seq_lens [T]
    → [T, top_k] int32 (kernels/topk_ref.topk_positions_ref's rule and output). With `return_paths`, also the
    int32 [T] path each row took (PATH_* above). `num_warps` / `scan_block`: launch shape (any power of two;
    benchmarks/tune_topk.py sweeps them). One launch, no host sync."""
    if scores.dim() != 2 or scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(f"scores must be a float32 [T, L] tensor with unit inner stride, got {scores.dtype} "
                         f"{tuple(scores.shape)} strides {scores.stride()}")
    if top_k <= 0:
        raise ValueError(f"top_k must be positive, got {top_k}")
    num_rows, width = scores.shape
    device = scores.device
    lens = seq_lens.to(device=device, dtype=torch.int64)
    if lens.shape != (num_rows,):
        raise ValueError(f"seq_lens must be [{num_rows}], got {tuple(seq_lens.shape)}")
    out = torch.empty((num_rows, top_k), dtype=torch.int32, device=device)
    paths = torch.empty(num_rows, dtype=torch.int32, device=device)
    if num_rows:
        capacity = candidate_capacity(top_k)
        cand_keys = torch.empty((num_rows, capacity), dtype=torch.int32, device=device)
        cand_pos = torch.empty((num_rows, capacity), dtype=torch.int32, device=device)
        _topk_kernel[(num_rows,)](
            scores, lens, out, cand_keys, cand_pos, paths,
            scores.stride(0), out.stride(0), cand_keys.stride(0), width, top_k,
            CAPACITY=capacity, BLOCK=scan_block, CHUNKS=SAMPLE_CHUNKS, CHUNK=SAMPLE_CHUNK, STAGES=SCAN_STAGES,
            num_warps=num_warps,
        )
    return (out, paths) if return_paths else out
