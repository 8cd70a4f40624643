# ruff: noqa  -- kept as it ran on the device (2026-11-28), a one-off experiment
"""Issue 23 item 1 (2026-11-28): the scores kernel with an L2 prefetch of the keys PF blocks ahead of the block it
multiplies (beyond the shared-memory pipeline's two tiles), so each program keeps more bytes in flight: at the
start, and in the tail, where the last programs run latency-bound. The row ids the prefetch needs are loaded one
iteration before it (a loop-carried value), so no iteration waits on them. Prefetches move no data into registers:
the scores are the product kernel's bits."""
import triton
import triton.language as tl


@triton.jit
def _prefetch_l2(ptrs):
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _bulk_prefetch_l2(ptrs):
    return tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 128; mov.u32 $0, 0;", "=r,l", [ptrs],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_rows(keys_ptr, rows, stride_keys, BULK: tl.constexpr):
    """The 128-byte key rows `rows` into the L2: one bulk prefetch a row, or one prefetch a 32-byte sector."""
    if BULK:
        _bulk_prefetch_l2(keys_ptr + tl.maximum(rows, 0) * stride_keys)
    else:
        sectors = tl.arange(0, 4) * 32
        _prefetch_l2(keys_ptr + tl.maximum(rows, 0)[:, None] * stride_keys + sectors[None, :])


@triton.jit(do_not_specialize=["max_len", "blocks_per_prog", "stride_rows_b"])
def _scores_pf(
    q_ptr, w_ptr, keys_ptr, scales_ptr, rows_ptr, req_ptr, lens_ptr, out_ptr,
    stride_qt, stride_qh, stride_wt, stride_keys, stride_rows_b, stride_rows_l, stride_out,
    num_heads, max_len, blocks_per_prog,
    HEADS_P: tl.constexpr, BLOCK_N: tl.constexpr, PF: tl.constexpr, START_PF: tl.constexpr, BULK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    span = tl.program_id(1)
    req = tl.load(req_ptr + t).to(tl.int64)
    seq_len = tl.minimum(tl.load(lens_ptr + t).to(tl.int64), max_len).to(tl.int32)
    start = span * blocks_per_prog * BLOCK_N
    scored_end = tl.minimum(tl.minimum(start + blocks_per_prog * BLOCK_N, max_len), seq_len)
    if scored_end > start:
        heads = tl.arange(0, HEADS_P)
        dims = tl.arange(0, 128)
        offs = tl.arange(0, BLOCK_N)
        head_ok = heads < num_heads
        row_base = rows_ptr + req * stride_rows_b
        if START_PF > 0:  # the first START_PF blocks' keys asked for at once, before q is loaded
            first = start + tl.arange(0, START_PF * BLOCK_N)
            rows0 = tl.load(row_base + first * stride_rows_l, mask=first < scored_end, other=0).to(tl.int64)
            _prefetch_rows(keys_ptr, rows0, stride_keys, BULK)
        q_at = q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :]
        w = tl.load(w_ptr + t * stride_wt + heads, mask=head_ok, other=0.0).to(tl.float32)
        q_op = tl.trans(tl.load(q_at, mask=head_ok[:, None], other=0).to(tl.float8e4nv, bitcast=True))
        out_base = out_ptr + t * stride_out
        num_blocks = (scored_end - start + BLOCK_N - 1) // BLOCK_N
        pos_next = start + offs
        rows_next = tl.load(row_base + pos_next * stride_rows_l, mask=pos_next < scored_end, other=-1).to(tl.int64)
        scale_next = tl.load(scales_ptr + rows_next, mask=(pos_next < scored_end) & (rows_next >= 0), other=0.0)
        if PF > 0:
            pos_far = start + PF * BLOCK_N + offs
            rows_far = tl.load(row_base + pos_far * stride_rows_l, mask=pos_far < scored_end, other=0).to(tl.int64)
        for i in range(0, num_blocks):
            pos = start + i * BLOCK_N + offs
            visible = pos < scored_end
            if PF > 0:  # keys of block i + PF into the L2; the row ids of block i + PF + 1 for the next iteration
                _prefetch_rows(keys_ptr, rows_far, stride_keys, BULK)
                pos_far = pos + (PF + 1) * BLOCK_N
                rows_far = tl.load(row_base + pos_far * stride_rows_l, mask=pos_far < scored_end, other=0).to(tl.int64)
            rows = tl.load(row_base + pos * stride_rows_l, mask=visible, other=-1).to(tl.int64)
            valid = visible & (rows >= 0)
            key_scale = scale_next
            pos_next = pos + BLOCK_N
            ahead = pos_next < scored_end
            rows_next = tl.load(row_base + pos_next * stride_rows_l, mask=ahead, other=-1).to(tl.int64)
            scale_next = tl.load(scales_ptr + rows_next, mask=ahead & (rows_next >= 0), other=0.0)
            raw = tl.load(keys_ptr + rows[:, None] * stride_keys + dims[None, :], mask=valid[:, None], other=0)
            logits = tl.dot(raw.to(tl.float8e4nv, bitcast=True), q_op)
            score = tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1) * key_scale
            tl.store(out_base + pos, score, mask=visible)
