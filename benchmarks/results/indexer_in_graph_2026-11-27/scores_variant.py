"""A copy of kernels/indexer_fast.py's scores kernel with experiment switches (session 20)."""
import triton
import triton.language as tl

from kernels.indexer_fast import _round_to_e4m3, _scale_heads  # noqa: F401


@triton.jit(do_not_specialize=["max_len", "blocks_per_prog", "stride_rows_b"])
def _scores_kernel_v(
    q_ptr, w_ptr, keys_ptr, scales_ptr, rows_ptr, req_ptr, lens_ptr, out_ptr,
    stride_qt, stride_qh, stride_wt, stride_keys, stride_rows_b, stride_rows_l, stride_out,
    num_heads, max_len, blocks_per_prog,
    HEADS_P: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, Q_E4M3: tl.constexpr, NOMASK: tl.constexpr,
):
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
        row_base = rows_ptr + req * stride_rows_b
        out_base = out_ptr + t * stride_out
        num_blocks = (scored_end - start + BLOCK_N - 1) // BLOCK_N
        # Main loop: row ids → key rows (both pipelined) → one dot → block scores × the keys' scales. The scales
        # (and the row ids they need) are loaded one block ahead: those loads feed no dot, so the pipeliner leaves
        # them synchronous, and loaded in the block that uses them they stalled every iteration on memory.
        pos_next = start + offs
        rows_next = tl.load(row_base + pos_next * stride_rows_l, mask=pos_next < scored_end, other=-1).to(tl.int64)
        scale_next = tl.load(scales_ptr + rows_next, mask=(pos_next < scored_end) & (rows_next >= 0), other=0.0)
        for i in range(0, num_blocks):
            pos = start + i * BLOCK_N + offs
            visible = pos < scored_end
            rows = tl.load(row_base + pos * stride_rows_l, mask=visible, other=-1).to(tl.int64)
            valid = visible & (rows >= 0)
            key_scale = scale_next  # 0 where the row id is < 0 or the position is not visible
            pos_next = pos + BLOCK_N
            ahead = pos_next < scored_end
            rows_next = tl.load(row_base + pos_next * stride_rows_l, mask=ahead, other=-1).to(tl.int64)
            scale_next = tl.load(scales_ptr + rows_next, mask=ahead & (rows_next >= 0), other=0.0)
            if NOMASK:
                raw = tl.load(keys_ptr + tl.where(valid, rows, 0)[:, None] * stride_keys + dims[None, :])
            else:
                raw = tl.load(keys_ptr + rows[:, None] * stride_keys + dims[None, :], mask=valid[:, None], other=0)
            if PRECISION == 2:
                logits = tl.dot(raw.to(tl.float8e4nv, bitcast=True), q_op)  # [BLOCK_N, HEADS_P]
            else:
                keys = raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)  # exact: e4m3 ⊂ fp16
                logits = tl.dot(keys, q_op)
                if PRECISION == 1:
                    logits = tl.dot(keys, q_lo, logits)
            score = tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1) * key_scale
            if NOMASK:
                score = tl.where(valid, score, 0.0)
            tl.store(out_base + pos, score, mask=visible)


