"""The MoE's dispatch (tokens sorted by expert) and combine (the weighted sum of each token's experts) as one
Triton kernel each, for CUDA tensors at decode's token counts.

Why: eager runs the dispatch as a stable radix sort of the choices, a sorted search for the experts' end offsets,
a division and an index gather of the rows, and the combine as an index scatter, a float32 copy, a mask, a
multiply, a sum over the experts, a cast and the shared experts' add — about ten launches per MoE layer that each
move a few kilobytes at decode batch sizes (profiled: ~40 µs a layer at batch 1, the same with bf16 and FP8
weights).

Semantics (the eager path in decode_server/model/moe.py `MoE.routed_grouped` is the reference):
  - dispatch: choice c = token · top_k + j (expert id ids[c]; other ranks' experts carry the sentinel id E, which
    sorts last) goes to position slot[c] = #{c' : ids[c'] < ids[c]} + #{c' < c : ids[c'] == ids[c]} — exactly
    where `torch.sort(ids.flatten(), stable=True)` puts it — and its token's row is copied there: xs[slot[c]] =
    x[c // top_k]. ends[e] = #{c : ids[c] ≤ e}, the experts' end offsets (`expert_end_offsets`). The grouped GEMMs
    therefore see the same rows in the same order as with the sort: the same bits.
  - combine: out[t] = Σ_j w[t, j] · ys[slot[t·top_k + j]] over the choices of this rank's experts (ids < E), in
    float32 in j order (each product rounded before it is added: compiled without fused multiply-adds), cast to the
    output dtype, plus `shared` (the shared experts' output) in that dtype — the eager path's arithmetic except
    that torch's sum over j may add in another order (float32 ulps).
Shared-experts fusion (`shared_expert=True`, decode_server/model/moe.py `MoE.fuses_shared`): the shared expert is the
stack's last expert E-1, and every token gets one more choice, j = top_k, with that id (not stored in the ids: the
kernels derive it). Its row is dispatched like the routed ones, so the grouped GEMMs run it with them; the combine
adds its output row (ys at its slot) where it added `shared`, in the same arithmetic.
Each dispatch program counts its choice's position over all n choices (O(n²) work in all), so the model uses it up
to `MOE_DISPATCH_MAX_CHOICES` choices (decode batches; decode_server/model/moe.py); larger batches keep the sort. No host sync, launch shapes depend only on
the shapes: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_CHOICES = 1024
_BLOCK_EXPERTS = 64
_BLOCK_ROW = 1024


@triton.jit
def _choice_ids(ids_ptr, idx, n, top_k, num_experts, SHARED: tl.constexpr):
    """The expert ids of choices `idx` (< n; 0 past n): stored ones, or with SHARED each token's last choice, the
    shared expert num_experts - 1."""
    if SHARED:
        token = idx // (top_k + 1)
        j = idx - token * (top_k + 1)
        routed = j < top_k
        stored = tl.load(ids_ptr + token * top_k + j, mask=(idx < n) & routed, other=0)
        return tl.where(routed, stored, num_experts - 1)
    else:
        return tl.load(ids_ptr + idx, mask=idx < n, other=0)


@triton.jit(do_not_specialize=["n", "num_experts"])
def _dispatch_kernel(ids_ptr, x_ptr, xs_ptr, slot_ptr, ends_ptr, n, top_k, num_experts, hidden, stride_x, stride_xs,
                     BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, SHARED: tl.constexpr):
    pid = tl.program_id(0)
    if pid < n:  # choice `pid`: its sorted position, and its token's row copied there
        mine = _choice_ids(ids_ptr, pid, n, top_k, num_experts, SHARED)
        before = tl.zeros([BLOCK_N], dtype=tl.int32)
        for start in range(0, n, BLOCK_N):
            idx = start + tl.arange(0, BLOCK_N)
            other = _choice_ids(ids_ptr, idx, n, top_k, num_experts, SHARED)
            earlier = (other < mine) | ((other == mine) & (idx < pid))
            before += (earlier & (idx < n)).to(tl.int32)
        slot = tl.sum(before, axis=0)
        tl.store(slot_ptr + pid, slot)
        src = x_ptr + (pid // (top_k + SHARED)).to(tl.int64) * stride_x
        dst = xs_ptr + slot.to(tl.int64) * stride_xs
        for h in range(0, hidden, BLOCK_H):
            cols = h + tl.arange(0, BLOCK_H)
            tl.store(dst + cols, tl.load(src + cols, mask=cols < hidden), mask=cols < hidden)
    else:  # a block of experts: their end offsets
        experts = (pid - n) * BLOCK_E + tl.arange(0, BLOCK_E)
        count = tl.zeros([BLOCK_E], dtype=tl.int32)
        for start in range(0, n, BLOCK_N):
            idx = start + tl.arange(0, BLOCK_N)
            other = _choice_ids(ids_ptr, idx, n, top_k, num_experts, SHARED)
            at_or_below = (other[None, :] <= experts[:, None]) & (idx < n)[None, :]
            count += tl.sum(at_or_below.to(tl.int32), axis=1)
        tl.store(ends_ptr + experts, count, mask=experts < num_experts)


@triton.jit(do_not_specialize=["num_experts"])
def _combine_kernel(ys_ptr, slot_ptr, ids_ptr, w_ptr, shared_ptr, out_ptr, num_experts, hidden, stride_ys, stride_w,
                    stride_shared, stride_out, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, HAS_SHARED: tl.constexpr,
                    SHARED_IN_YS: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = cols < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        choice = token * TOP_K + j
        slot = tl.load(slot_ptr + token * (TOP_K + SHARED_IN_YS) + j).to(tl.int64)
        owned = tl.load(ids_ptr + choice) < num_experts
        weight = tl.load(w_ptr + token * stride_w + j).to(tl.float32)
        y = tl.load(ys_ptr + slot * stride_ys + cols, mask=in_row & owned, other=0.0).to(tl.float32)
        acc += y * weight
    out = acc.to(out_ptr.dtype.element_ty)
    if HAS_SHARED:
        shared = tl.load(shared_ptr + token * stride_shared + cols, mask=in_row, other=0.0)
        out = (out.to(tl.float32) + shared.to(tl.float32)).to(out_ptr.dtype.element_ty)
    if SHARED_IN_YS:  # the shared expert's row, dispatched as each token's last choice
        slot = tl.load(slot_ptr + token * (TOP_K + 1) + TOP_K).to(tl.int64)
        shared = tl.load(ys_ptr + slot * stride_ys + cols, mask=in_row, other=0.0)
        out = (out.to(tl.float32) + shared.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * stride_out + cols, out, mask=in_row)


def dispatch(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, shared_expert: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], expert_ids [T, top_k] (this rank's ids, the sentinel `num_experts` for others') → (xs [n, H]
    rows sorted by expert, slot [n] int32 each choice's row in xs, ends [E] int32 end offsets), n = T · top_k, or
    T · (top_k + 1) with `shared_expert`: each token's extra last choice is expert num_experts - 1 (module
    docstring)."""
    num_tokens, top_k = expert_ids.shape
    n = num_tokens * (top_k + int(shared_expert))
    ids = expert_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    hidden = x.shape[1]
    xs = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    slot = torch.empty(n, dtype=torch.int32, device=x.device)
    ends = torch.empty(num_experts, dtype=torch.int32, device=x.device)
    grid = (n + triton.cdiv(num_experts, _BLOCK_EXPERTS),)
    _dispatch_kernel[grid](ids, x, xs, slot, ends, n, top_k, num_experts, hidden, x.stride(0), xs.stride(0),
                           BLOCK_N=min(_BLOCK_CHOICES, triton.next_power_of_2(n)), BLOCK_E=_BLOCK_EXPERTS,
                           BLOCK_H=min(_BLOCK_ROW, triton.next_power_of_2(hidden)), SHARED=int(shared_expert),
                           num_warps=4)
    return xs, slot, ends


def combine(ys: torch.Tensor, slot: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
            shared: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
            shared_in_ys: bool = False) -> torch.Tensor:
    """ys [n, H] (the experts' outputs in dispatch order), weights [T, top_k] → [T, H] in `out_dtype`
    (default ys's): Σ_j w · ys over this rank's choices, plus `shared` [T, H] if given, or with `shared_in_ys` (a
    dispatch with `shared_expert`) plus each token's shared-expert row of ys (module docstring)."""
    if shared is not None and shared_in_ys:
        raise ValueError("the shared experts' output is either `shared` or rows of ys, not both")
    num_tokens, top_k = expert_ids.shape
    hidden = ys.shape[1]
    ids = expert_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    out = torch.empty(num_tokens, hidden, dtype=out_dtype or ys.dtype, device=ys.device)
    if num_tokens == 0:
        return out
    if shared is not None and shared.stride(-1) != 1:
        shared = shared.contiguous()
    block = min(_BLOCK_ROW, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
        ys, slot, ids, weights, shared if shared is not None else out, out, num_experts, hidden, ys.stride(0),
        weights.stride(0), shared.stride(0) if shared is not None else 0, out.stride(0),
        TOP_K=top_k, BLOCK_H=block, HAS_SHARED=shared is not None, SHARED_IN_YS=int(shared_in_ys), num_warps=4,
        enable_fp_fusion=False)  # a multiply, then an add, as eager rounds them (no fused multiply-add)
    return out
