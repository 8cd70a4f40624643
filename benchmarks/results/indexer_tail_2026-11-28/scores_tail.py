# ruff: noqa  -- kept as it ran on the device (2026-11-28), a one-off experiment
"""Issue 23 item 1, B 16 at 32K (2026-11-28): where the scores kernel's once-per-call cost goes, and whether a
work queue (programs take chunks of blocks from an atomic counter) removes a tail.

`_scores_timed`: the product's e4m3-q path (kernels/indexer_fast.py `_scores_kernel`, Q_E4M3) that also records,
per program, %globaltimer at entry, after its first block's store (FIRST) and at exit, and its SM id.
`_scores_queue`: the same block math (same bits: a block's scores depend on nothing else), the grid = resident
programs; each takes chunks of CHUNK blocks (chunk c: query c % T, span c // T) until none is left; the last program
to finish resets the counter (no memset launch, graph-safe)."""
import triton
import triton.language as tl


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _smid():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["max_len", "blocks_per_prog", "stride_rows_b"])
def _scores_timed(
    q_ptr, w_ptr, keys_ptr, scales_ptr, rows_ptr, req_ptr, lens_ptr, out_ptr, ts_ptr,
    stride_qt, stride_qh, stride_wt, stride_keys, stride_rows_b, stride_rows_l, stride_out,
    num_heads, max_len, blocks_per_prog,
    HEADS_P: tl.constexpr, BLOCK_N: tl.constexpr, FIRST: tl.constexpr,
):
    t0 = _now()
    t = tl.program_id(0).to(tl.int64)
    span = tl.program_id(1)
    prog = t * tl.num_programs(1) + span
    req = tl.load(req_ptr + t).to(tl.int64)
    seq_len = tl.minimum(tl.load(lens_ptr + t).to(tl.int64), max_len).to(tl.int32)
    start = span * blocks_per_prog * BLOCK_N
    scored_end = tl.minimum(tl.minimum(start + blocks_per_prog * BLOCK_N, max_len), seq_len)
    if scored_end > start:
        heads = tl.arange(0, HEADS_P)
        dims = tl.arange(0, 128)
        offs = tl.arange(0, BLOCK_N)
        head_ok = heads < num_heads
        q_at = q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :]
        w = tl.load(w_ptr + t * stride_wt + heads, mask=head_ok, other=0.0).to(tl.float32)
        q_op = tl.trans(tl.load(q_at, mask=head_ok[:, None], other=0).to(tl.float8e4nv, bitcast=True))
        row_base = rows_ptr + req * stride_rows_b
        out_base = out_ptr + t * stride_out
        num_blocks = (scored_end - start + BLOCK_N - 1) // BLOCK_N
        pos_next = start + offs
        rows_next = tl.load(row_base + pos_next * stride_rows_l, mask=pos_next < scored_end, other=-1).to(tl.int64)
        scale_next = tl.load(scales_ptr + rows_next, mask=(pos_next < scored_end) & (rows_next >= 0), other=0.0)
        for i in range(0, num_blocks):
            pos = start + i * BLOCK_N + offs
            visible = pos < scored_end
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
            if FIRST:
                if i == 0:
                    tl.store(ts_ptr + prog * 4 + 1, _now())
    tl.store(ts_ptr + prog * 4 + 0, t0)
    tl.store(ts_ptr + prog * 4 + 2, _now())
    tl.store(ts_ptr + prog * 4 + 3, _smid().to(tl.int64))


@triton.jit(do_not_specialize=["max_len", "stride_rows_b", "spans", "num_q", "num_programs"])
def _scores_queue(
    q_ptr, w_ptr, keys_ptr, scales_ptr, rows_ptr, req_ptr, lens_ptr, out_ptr, counter_ptr,
    stride_qt, stride_qh, stride_wt, stride_keys, stride_rows_b, stride_rows_l, stride_out,
    num_heads, max_len, num_q, spans, num_programs,
    HEADS_P: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
):
    heads = tl.arange(0, HEADS_P)
    dims = tl.arange(0, 128)
    offs = tl.arange(0, BLOCK_N)
    head_ok = heads < num_heads
    total = num_q * spans
    c = tl.atomic_add(counter_ptr, 1)
    while c < total:
        t = (c % num_q).to(tl.int64)
        span = c // num_q
        req = tl.load(req_ptr + t).to(tl.int64)
        seq_len = tl.minimum(tl.load(lens_ptr + t).to(tl.int64), max_len).to(tl.int32)
        start = span * CHUNK * BLOCK_N
        scored_end = tl.minimum(tl.minimum(start + CHUNK * BLOCK_N, max_len), seq_len)
        q_at = q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :]
        w = tl.load(w_ptr + t * stride_wt + heads, mask=head_ok, other=0.0).to(tl.float32)
        q_op = tl.trans(tl.load(q_at, mask=head_ok[:, None], other=0).to(tl.float8e4nv, bitcast=True))
        row_base = rows_ptr + req * stride_rows_b
        out_base = out_ptr + t * stride_out
        num_blocks = tl.maximum(scored_end - start + BLOCK_N - 1, 0) // BLOCK_N
        pos_next = start + offs
        rows_next = tl.load(row_base + pos_next * stride_rows_l, mask=pos_next < scored_end, other=-1).to(tl.int64)
        scale_next = tl.load(scales_ptr + rows_next, mask=(pos_next < scored_end) & (rows_next >= 0), other=0.0)
        for i in range(0, num_blocks):
            pos = start + i * BLOCK_N + offs
            visible = pos < scored_end
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
        c = tl.atomic_add(counter_ptr, 1)
    done = tl.atomic_add(counter_ptr + 1, 1)
    if done == num_programs - 1:  # every program has taken its last (empty) chunk: reset for the next call
        tl.store(counter_ptr, 0)
        tl.store(counter_ptr + 1, 0)
