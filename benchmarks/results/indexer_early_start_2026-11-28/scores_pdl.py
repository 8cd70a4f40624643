# ruff: noqa  -- kept as it ran on the device (2026-11-28), a one-off experiment
"""Issue 23 item 1 (2026-11-28): the scores kernel behind programmatic dependent launch (PDL), after the engine's
real predecessor — the index-key write — done as one Triton kernel that lets its dependents launch at its start.

MODE 0: the product kernel's body (launched without PDL).
MODE 1: PDL, griddepcontrol.wait first (only the launch overlaps).
MODE 2: PDL; before the wait: the request, its length and the first block's row ids (tables the engine fills in
        begin_forward, before the layer); after: q, w, scales, keys.
MODE 3: MODE 2 and q / w before the wait too (the engine's q kernel runs before the write).
MODE 4: MODE 3 and the first block's key rows asked into the L2 before the wait (a prefetch: a line the write
        changes afterwards is read fresh from the L2 after the wait).
MODE 5: MODE 2 and, before the wait, the row ids of the first PF blocks loaded and their key rows and scales
        asked into the L2 (the main loop's first iterations then find rows, keys and scales there).
The scores are the product kernel's bits in every mode (the same loop after the wait)."""
import triton
import triton.language as tl


@triton.jit
def _prefetch_l2(ptrs):
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _write_rows_kernel(keys_ptr, scales_ptr, rows_ptr, dst_keys_ptr, dst_scales_ptr, stride_src, stride_dst, num,
                       TRIGGER: tl.constexpr, BLOCK_T: tl.constexpr):
    """keys [T, 128] u8 and scales [T] f32 → dst rows `rows[T]`: the index-key write in one kernel."""
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < num
    dims = tl.arange(0, 128)
    row = tl.load(rows_ptr + t, mask=ok, other=0).to(tl.int64)
    k = tl.load(keys_ptr + t[:, None].to(tl.int64) * stride_src + dims[None, :], mask=ok[:, None], other=0)
    tl.store(dst_keys_ptr + row[:, None] * stride_dst + dims[None, :], k, mask=ok[:, None])
    s = tl.load(scales_ptr + t, mask=ok, other=0.0)
    tl.store(dst_scales_ptr + row, s, mask=ok)


@triton.jit(do_not_specialize=["max_len", "blocks_per_prog", "stride_rows_b"])
def _scores_pdl(
    q_ptr, w_ptr, keys_ptr, scales_ptr, rows_ptr, req_ptr, lens_ptr, out_ptr,
    stride_qt, stride_qh, stride_wt, stride_keys, stride_rows_b, stride_rows_l, stride_out,
    num_heads, max_len, blocks_per_prog,
    HEADS_P: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, PF: tl.constexpr = 1,
):
    if MODE == 1:
        tl.extra.cuda.gdc_wait()
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
        q_at = q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :]
        row_base = rows_ptr + req * stride_rows_b
        out_base = out_ptr + t * stride_out
        num_blocks = (scored_end - start + BLOCK_N - 1) // BLOCK_N
        pos_next = start + offs
        rows_next = tl.load(row_base + pos_next * stride_rows_l, mask=pos_next < scored_end, other=-1).to(tl.int64)
        if MODE >= 3:
            w = tl.load(w_ptr + t * stride_wt + heads, mask=head_ok, other=0.0).to(tl.float32)
            q_op = tl.trans(tl.load(q_at, mask=head_ok[:, None], other=0).to(tl.float8e4nv, bitcast=True))
        if MODE == 4:
            sectors = tl.arange(0, 4) * 32
            _prefetch_l2(keys_ptr + tl.maximum(rows_next, 0)[:, None] * stride_keys + sectors[None, :])
        if MODE == 5:
            first = start + tl.arange(0, PF * BLOCK_N)
            rows0 = tl.load(row_base + first * stride_rows_l, mask=first < scored_end, other=0).to(tl.int64)
            sectors = tl.arange(0, 4) * 32
            _prefetch_l2(keys_ptr + rows0[:, None] * stride_keys + sectors[None, :])
            _prefetch_l2(scales_ptr + rows0)
        if MODE >= 2:
            tl.extra.cuda.gdc_wait()
        if MODE < 3:
            w = tl.load(w_ptr + t * stride_wt + heads, mask=head_ok, other=0.0).to(tl.float32)
            q_op = tl.trans(tl.load(q_at, mask=head_ok[:, None], other=0).to(tl.float8e4nv, bitcast=True))
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
