"""The previous GPU indexer path, kept as the benchmark's baseline: Triton scores, then torch.topk.

The engine runs kernels/indexer_fast.py instead (benchmarks/bench_indexer.py compares the two). This path's
selection is best first, in torch.topk's order, equal scores in whatever order torch.topk leaves them: not the
engine's rule (kernels/topk_ref.py).

One program per (query, span of positions). The program loads its query's heads once, scales each head by a
power of two (folded back into its weight, so the score is unchanged) and splits it into fp16 hi + lo parts
(q ≈ hi + lo to ~22 mantissa bits). For each block of BLOCK_N positions it gathers the key rows through
token_rows, converts FP8 e4m3 → fp16 in registers (exact: every e4m3 value is an fp16 value), runs two
tensor-core dots (keys · hi, keys · lo, fp32 accumulation), ReLU, the weighted head sum, times the key's scale,
−inf beyond the query's seq_len. The fp32 scores [T, L] then go through torch.topk. A bf16 variant (no scaling,
~16 bits) and a heads-as-M dot orientation are kept as launch options for the benchmark's comparison.

Nothing here syncs with the host: the scored width is token_rows.shape[1] (the engine slices token_rows to the
batch's longest request) and the launch shape depends only on host-known sizes. BLOCK_N is the same for every
batch shape, so a query's scores depend only on its own inputs, never on the other queries of the batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

INDEX_HEAD_DIM = 128
# Bound on the fp32 scores [queries, positions] materialized at once (elements): 512 MiB.
MAX_SCORES = 1 << 27


@dataclass(frozen=True)
class ScoresConfig:
    """Launch shape of the scores kernel. block_n must stay fixed across batches (see module docstring)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    blocks_per_program: int | None = None  # None: chosen from the batch shape and the SM count
    fp16: bool = True  # dot operands fp16 (q hi + lo ≈ 22 bits) rather than bf16 (≈ 16 bits)
    heads_as_m: bool = False  # dot as q [heads, 128] · keysᵀ rather than keys · qᵀ


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def blocks_per_program(num_q: int, max_len: int, block_n: int, device: torch.device) -> int:
    """Position blocks each program scores: enough programs to fill the GPU (~16 per SM), as few q reloads
    as that allows."""
    blocks = triton.cdiv(max_len, block_n)
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(64, blocks, (num_q * blocks) // (16 * sms)))


# The batch's length and the work split change from step to step; letting Triton specialize on them (divisible
# by 16 or not) would compile new variants in the middle of serving. The token table's row stride is left
# unspecialized too (a caller may pass a compacted copy); the output's row stride is padded instead (below).
@triton.jit(do_not_specialize=["max_len", "blocks_per_prog", "stride_rows_b"])
def _indexer_scores_kernel(
    q_ptr, w_ptr, keys_ptr, scales_ptr, rows_ptr, req_ptr, lens_ptr, out_ptr,
    stride_qt, stride_qh, stride_wt, stride_keys, stride_rows_b, stride_rows_l, stride_out,
    num_heads, max_len, blocks_per_prog,
    HEADS_P: tl.constexpr, BLOCK_N: tl.constexpr, FP16: tl.constexpr, HEADS_AS_M: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    span = tl.program_id(1)
    heads = tl.arange(0, HEADS_P)
    dims = tl.arange(0, 128)
    offs = tl.arange(0, BLOCK_N)
    head_ok = heads < num_heads

    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=head_ok[:, None],
                other=0.0).to(tl.float32)
    w = tl.load(w_ptr + t * stride_wt + heads, mask=head_ok, other=0.0).to(tl.float32)
    if FP16:
        # fp16 has fp32's precision per part but not its range: scale each head by 2^s so that its largest
        # |q| lies in [256, 512), and w by 2^-s. Powers of two and ReLU(2^s·x) = 2^s·ReLU(x): same score.
        exp_field = (tl.max(tl.abs(q), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF
        s = tl.minimum(tl.maximum(135 - exp_field, -60), 60)
        q = q * ((s + 127) << 23).to(tl.float32, bitcast=True)[:, None]
        w = w * ((127 - s) << 23).to(tl.float32, bitcast=True)
        q_hi = q.to(tl.float16)
        q_lo = (q - q_hi.to(tl.float32)).to(tl.float16)
    else:
        q_hi = q.to(tl.bfloat16)
        q_lo = (q - q_hi.to(tl.float32)).to(tl.bfloat16)
    q_hi_t = tl.trans(q_hi)  # [128, HEADS_P]
    q_lo_t = tl.trans(q_lo)

    req = tl.load(req_ptr + t).to(tl.int64)
    seq_len = tl.minimum(tl.load(lens_ptr + t).to(tl.int64), max_len).to(tl.int32)
    row_base = rows_ptr + req * stride_rows_b
    out_base = out_ptr + t * stride_out

    start = span * blocks_per_prog * BLOCK_N
    end = tl.minimum(start + blocks_per_prog * BLOCK_N, max_len)
    scored_end = tl.minimum(end, seq_len)

    # Blocks holding a visible position, then blocks wholly beyond seq_len (−inf, nothing read). Loop bounds
    # rather than a branch in the loop, so that the compiler can pipeline the gathers.
    num_scored = (tl.maximum(scored_end - start, 0) + BLOCK_N - 1) // BLOCK_N
    for i in range(0, num_scored):
        pos = start + i * BLOCK_N + offs
        visible = pos < scored_end
        rows = tl.load(row_base + pos * stride_rows_l, mask=visible, other=-1).to(tl.int64)
        valid = visible & (rows >= 0)
        raw = tl.load(keys_ptr + rows[:, None] * stride_keys + dims[None, :], mask=valid[:, None], other=0)
        if FP16:
            keys = raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)  # exact: e4m3 ⊂ fp16
        else:
            keys = raw.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)  # exact: e4m3 ⊂ bf16
        if HEADS_AS_M:
            keys_t = tl.trans(keys)
            logits = tl.dot(q_hi, keys_t)  # [HEADS_P, BLOCK_N]
            logits = tl.dot(q_lo, keys_t, logits)
            score = tl.sum(tl.maximum(logits, 0.0) * w[:, None], axis=0)
        else:
            logits = tl.dot(keys, q_hi_t)  # [BLOCK_N, HEADS_P]
            logits = tl.dot(keys, q_lo_t, logits)
            score = tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1)
        score = score * tl.load(scales_ptr + rows, mask=valid, other=0.0)
        score = tl.where(visible, score, float("-inf"))
        tl.store(out_base + pos, score, mask=pos < end)
    for blank in range(start + num_scored * BLOCK_N, end, BLOCK_N):
        pos = blank + offs
        tl.store(out_base + pos, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=pos < end)


def indexer_scores_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys_fp8: torch.Tensor,
    scales: torch.Tensor,
    token_rows: torch.Tensor,
    token_req: torch.Tensor,
    seq_lens: torch.Tensor,
    config: ScoresConfig | None = None,
) -> torch.Tensor:
    """fp32 scores [T, L] (L = token_rows.shape[1]), −inf at positions >= seq_len. Arguments as in
    kernels/indexer_ref.py; q and weights may be any float dtype (computed in fp32)."""
    cfg = config or ScoresConfig()
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
    per_prog = cfg.blocks_per_program or blocks_per_program(num_q, max_len, cfg.block_n, q.device)
    grid = (num_q, triton.cdiv(max_len, per_prog * cfg.block_n))
    _indexer_scores_kernel[grid](
        q, weights, keys_fp8.view(torch.uint8), scales, token_rows, token_req, seq_lens, out,
        q.stride(0), q.stride(1), weights.stride(0), keys_fp8.stride(0), token_rows.stride(0),
        token_rows.stride(1), out.stride(0),
        heads, max_len, per_prog,
        HEADS_P=max(16, triton.next_power_of_2(heads)), BLOCK_N=cfg.block_n, FP16=cfg.fp16,
        HEADS_AS_M=cfg.heads_as_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def indexer_topk_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys_fp8: torch.Tensor,
    scales: torch.Tensor,
    token_rows: torch.Tensor,
    token_req: torch.Tensor,
    seq_lens: torch.Tensor,
    top_k: int,
    config: ScoresConfig | None = None,
) -> torch.Tensor:
    """[T, top_k] int32 positions, best first (torch.topk's order and tie handling), −1 pads; queries with
    seq_len <= top_k get 0..seq_len−1 ascending. No host sync. The previous path (module docstring)."""
    num_q = q.shape[0]
    max_len = token_rows.shape[1]
    device = q.device
    seq = seq_lens.to(device=device, dtype=torch.int64)
    ar = torch.arange(top_k, device=device, dtype=torch.int64)
    dense = torch.where(ar.unsqueeze(0) < seq.unsqueeze(1), ar.unsqueeze(0), -1).to(torch.int32)
    if num_q == 0 or max_len <= top_k:
        return dense  # every request fits: attention is dense over 0..n-1
    req = token_req.to(device=device, dtype=torch.int64)
    picked = torch.empty((num_q, top_k), dtype=torch.int32, device=device)
    chunk = max(1, MAX_SCORES // max_len)
    for start in range(0, num_q, chunk):
        end = min(num_q, start + chunk)
        scores = indexer_scores_triton(q[start:end], weights[start:end], keys_fp8, scales, token_rows,
                                       req[start:end], seq[start:end], config)
        picked[start:end] = torch.topk(scores, top_k, dim=1, sorted=True).indices.to(torch.int32)
    return torch.where((seq <= top_k).unsqueeze(1), dense, picked)
