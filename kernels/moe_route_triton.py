"""The MoE router's selection ("noaux_tc": sigmoid scores, group-limited top-k on biased scores) as one Triton
kernel, one program per token, for CUDA tensors.

Why: eager runs it as ~15 small kernels per MoE layer (sigmoid, bias add, a top-2 per group, the groups' top-k,
a scatter into a mask, a masked fill, the experts' top-k with its sorts, a gather, the normalization), which at
decode batch sizes cost far more than the few hundred bytes they touch.

Semantics: `decode_server.model.moe.route_tokens` (the reference and the CPU path), with one defined tie rule:
among equal values the lower index wins, for the groups and for the experts (torch.topk leaves ties unspecified).
The scores' sigmoid may differ from eager's in the last bit, so a near-tie can select differently from eager;
every engine mode runs this same kernel, so HiSparse == dense is unaffected. Expert ids come out in descending
order of their biased score, as `topk` gives them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(logits_ptr, logits_stride, bias_ptr, weights_ptr, ids_ptr, num_experts, scaling,
                  N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                  TOP_K_BLOCK: tl.constexpr, NORMALIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    E: tl.constexpr = N_GROUP * GROUP_SIZE
    e = tl.arange(0, E)
    valid = e < num_experts
    logit = tl.load(logits_ptr + row * logits_stride + e, mask=valid, other=0.0).to(tl.float32)
    score = 1.0 / (1.0 + tl.exp(-logit))
    biased = tl.where(valid, score + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32), float("-inf"))
    if N_GROUP > 1:
        grouped = tl.reshape(biased, (N_GROUP, GROUP_SIZE))
        member = tl.arange(0, GROUP_SIZE)[None, :]
        best = tl.max(grouped, axis=1)
        rating = best
        if GROUP_SIZE > 1:  # a group is rated by the sum of its two best biased scores
            first = tl.argmax(grouped, axis=1, tie_break_left=True)
            rating = best + tl.max(tl.where(member == first[:, None], float("-inf"), grouped), axis=1)
        group = tl.arange(0, N_GROUP)
        keep = group < 0
        for _ in tl.static_range(TOPK_GROUP):
            g = tl.argmax(rating, axis=0, tie_break_left=True)
            keep = keep | (group == g)
            rating = tl.where(group == g, float("-inf"), rating)
        kept = tl.reshape(tl.broadcast_to(keep[:, None], (N_GROUP, GROUP_SIZE)), (E,))
        biased = tl.where(kept, biased, float("-inf"))
    slot = tl.arange(0, TOP_K_BLOCK)
    chosen_ids = tl.zeros((TOP_K_BLOCK,), dtype=tl.int64)
    chosen_w = tl.zeros((TOP_K_BLOCK,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        i = tl.argmax(biased, axis=0, tie_break_left=True)
        w = tl.sum(tl.where(e == i, score, 0.0), axis=0)
        chosen_ids = tl.where(slot == k, i.to(tl.int64), chosen_ids)
        chosen_w = tl.where(slot == k, w, chosen_w)
        biased = tl.where(e == i, float("-inf"), biased)
    if NORMALIZE:
        chosen_w = chosen_w / (tl.sum(chosen_w, axis=0) + 1e-20)
    out = slot < TOP_K
    tl.store(weights_ptr + row * TOP_K + slot, chosen_w * scaling, mask=out)
    tl.store(ids_ptr + row * TOP_K + slot, chosen_ids, mask=out)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supports(logits: torch.Tensor, n_group: int, topk_group: int, top_k: int) -> bool:
    """CUDA float logits [T, E] with a contiguous last dim, E a power of two split into power-of-two groups."""
    if not (logits.is_cuda and logits.dim() == 2 and logits.shape[0] > 0 and logits.stride(-1) == 1):
        return False
    num_experts = logits.shape[1]
    groups = max(1, n_group)
    return (_pow2(num_experts) and _pow2(groups) and num_experts % groups == 0 and 0 < top_k <= num_experts
            and num_experts <= 1024 and (groups == 1 or 0 < topk_group <= groups))


def route(logits: torch.Tensor, correction_bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
          norm_topk_prob: bool, routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits → (weights [T, top_k] float32, expert ids [T, top_k] int64), as `route_tokens`."""
    num_tokens, num_experts = logits.shape
    groups = max(1, n_group)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    bias = correction_bias if correction_bias.is_contiguous() else correction_bias.contiguous()
    _route_kernel[(num_tokens,)](
        logits, logits.stride(0), bias, weights, ids, num_experts, float(routed_scaling_factor),
        N_GROUP=groups, GROUP_SIZE=num_experts // groups, TOPK_GROUP=topk_group if groups > 1 else 1, TOP_K=top_k,
        TOP_K_BLOCK=triton.next_power_of_2(top_k), NORMALIZE=bool(norm_topk_prob),
        num_warps=4 if num_experts >= 128 else 1)
    return weights, ids
