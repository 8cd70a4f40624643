"""DeepSeek-V3 mixture of experts: grouped top-k routing with sigmoid scores and a selection-only bias.

Routing ("noaux_tc"): scores = sigmoid(router logits). Selection uses `scores + e_score_correction_bias`:
experts are split into `n_group` groups, each group is rated by the sum of its two best biased scores, the best
`topk_group` groups survive, and the `num_experts_per_tok` best biased scores among their experts are chosen.
The mixing weights are the *unbiased* scores of the chosen experts, renormalized to sum to 1 when
`norm_topk_prob`, then multiplied by `routed_scaling_factor`. Shared experts see every token.
"""

from __future__ import annotations

import torch
from torch import nn

from decode_server.model.config import ModelConfig
from decode_server.model.layers import MLP


def route_tokens(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    n_group: int,
    topk_group: int,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] float32 logits → (weights [T, top_k] float32, expert ids [T, top_k] int64)."""
    num_tokens, num_experts = router_logits.shape
    scores = torch.sigmoid(router_logits.float())
    biased = scores + correction_bias.float()
    if n_group > 1:
        grouped = biased.view(num_tokens, n_group, num_experts // n_group)
        group_rating = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # [T, G]
        kept_groups = group_rating.topk(topk_group, dim=-1).indices
        group_keep = torch.zeros_like(group_rating, dtype=torch.bool).scatter_(1, kept_groups, True)
        expert_keep = group_keep.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        biased = biased.masked_fill(~expert_keep, float("-inf"))
    expert_ids = biased.topk(top_k, dim=-1).indices
    weights = scores.gather(1, expert_ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, expert_ids


class MoEGate(nn.Module):
    """Router weights (kept in float32) and the per-expert selection bias."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        logits = torch.nn.functional.linear(x.float(), self.weight.float())
        return route_tokens(
            logits, self.e_score_correction_bias, c.n_group, c.topk_group, c.num_experts_per_tok,
            c.norm_topk_prob, c.routed_scaling_factor,
        )


class MoE(nn.Module):
    """Routed experts + shared experts. Tokens are grouped per expert with one host sync per call."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.gate = MoEGate(config)
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.n_routed_experts)
        )
        self.shared_experts = MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(x)
        top_k = expert_ids.shape[1]
        flat_ids = expert_ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // top_k
        weight_of = weights.flatten()[order]
        routed = torch.zeros_like(x)
        start = 0
        for expert_id, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[start : start + count]
            out = self.experts[expert_id](x[tokens]) * weight_of[start : start + count, None]
            routed.index_add_(0, tokens, out.to(routed.dtype))
            start += count
        return routed + self.shared_experts(x)
