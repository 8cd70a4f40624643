"""Near-ties in the MoE router, for comparing two runs whose logits differ by rounding (CUDA graphs on vs off).

A random-weight model amplifies rounding: when two runs of the same requests route one token to different experts,
that layer's output and every later logit differ by far more than the rounding that caused it, so a greedy token
that then differs cannot be judged by its logits margin alone (tests/hisparse/test_cuda_graph_gpu.py (c)). It is a
near-tie if the routing decision that flipped first was one: the chosen option's margin over the other, in either
run, is within the largest difference of the same values that the two runs showed at decisions where they agreed
(measured before any request's first flip, so by rounding only).

The router selects in two stages (decode_server/model/moe.py `route_tokens`): groups by their rating (the sum of
their two best scores, score = sigmoid(logit) + bias), then experts by score inside the kept groups. A flip is
judged at the stage where the two runs first differ: group ratings if the kept groups differ, else expert scores.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from decode_server.model.moe import MoEGate


@dataclass
class Decision:
    """One token's routing at one MoE layer: its scores (sigmoid + bias, float32) and the experts chosen."""

    scores: torch.Tensor  # [E]
    experts: frozenset[int]


@dataclass
class RoutingTrace:
    """(request id, token index) → that decode step's decisions, one per MoE layer in layer order."""

    n_group: int
    topk_group: int
    steps: dict[tuple[str, int], list[Decision]] = field(default_factory=dict)


def record_routing(engine, model: torch.nn.Module) -> tuple[RoutingTrace, Callable[[], None]]:
    """Hooks on `model`'s MoE gates that record every decode step of `engine` (run it eagerly: a replayed CUDA graph
    calls no hooks), each request's row filed under the token that step produces. Returns (the trace, the function
    removing the hooks)."""
    gates = [m for m in model.modules() if isinstance(m, MoEGate)]
    if not gates:
        raise ValueError("the model has no MoE layer")
    config = gates[0].config
    trace = RoutingTrace(config.n_group, config.topk_group)

    layer_of = {id(gate): i for i, gate in enumerate(gates)}

    def on_gate(module: MoEGate, inputs: tuple, output: tuple) -> None:
        batch = engine.kv.backend._batch
        if batch is None or not batch.is_decode:
            return
        x = inputs[0].float()
        scores = (torch.sigmoid(x @ module.weight.float().t()) + module.e_score_correction_bias.float()).cpu()
        experts = output[1].cpu()
        by_row = {r.row: r for r in engine.scheduler.running}
        for j, (row, seq_len) in enumerate(zip(batch.req_rows_cpu, batch.seq_lens_cpu, strict=True)):
            req = by_row.get(row)
            if req is None:
                continue  # a padding row (the scratch row)
            # The step reads the token at position seq_len - 1 and produces output token seq_len - prompt length.
            key = (req.rid, seq_len - len(req.prompt_ids))
            if layer_of[id(module)] == 0:  # a new step (or the same token again after a retraction)
                trace.steps[key] = []
            trace.steps[key].append(Decision(scores[j], frozenset(experts[j].tolist())))

    handles = [gate.register_forward_hook(on_gate) for gate in gates]
    return trace, lambda: [h.remove() for h in handles]


def _kept_groups(scores: torch.Tensor, n_group: int, topk_group: int) -> tuple[frozenset[int], torch.Tensor]:
    ratings = scores.view(n_group, -1).topk(min(2, scores.numel() // n_group), dim=-1).values.sum(-1)
    return frozenset(ratings.topk(topk_group).indices.tolist()), ratings


@dataclass
class Flip:
    rid: str
    token: int
    layer: int
    stage: str  # "groups" or "experts"
    margin: float  # the chosen option's margin over the other, the larger of the two runs'


def first_flips(a: RoutingTrace, b: RoutingTrace, until: dict[str, int]) -> tuple[dict[str, float], list[Flip]]:
    """Each request's first routing flip between runs `a` and `b` (up to token `until[rid]` inclusive, where its
    tokens part), and the bound per stage: the largest difference between the runs' group ratings and expert
    scores over every decision made before its request's first flip."""
    bound = {"groups": 0.0, "experts": 0.0}
    flips: list[Flip] = []
    for rid, last in until.items():
        for token in range(last + 1):
            da, db = a.steps.get((rid, token)), b.steps.get((rid, token))
            if da is None or db is None:
                continue
            flip = None
            for layer, (x, y) in enumerate(zip(da, db, strict=True)):
                groups_x, ratings_x = _kept_groups(x.scores, a.n_group, a.topk_group)
                groups_y, ratings_y = _kept_groups(y.scores, b.n_group, b.topk_group)
                if groups_x != groups_y:
                    (g_in,), (g_out,) = sorted(groups_x - groups_y)[:1], sorted(groups_y - groups_x)[:1]
                    margin = max(float(ratings_x[g_in] - ratings_x[g_out]), float(ratings_y[g_out] - ratings_y[g_in]))
                    flip = Flip(rid, token, layer, "groups", margin)
                elif x.experts != y.experts:
                    (e_in,), (e_out,) = sorted(x.experts - y.experts)[:1], sorted(y.experts - x.experts)[:1]
                    margin = max(float(x.scores[e_in] - x.scores[e_out]), float(y.scores[e_out] - y.scores[e_in]))
                    flip = Flip(rid, token, layer, "experts", margin)
                if flip is not None:
                    break
                bound["groups"] = max(bound["groups"], float((ratings_x - ratings_y).abs().max()))
                bound["experts"] = max(bound["experts"], float((x.scores - y.scores).abs().max()))
            if flip is not None:
                flips.append(flip)
                break
    return bound, flips


def explain_divergences(a: RoutingTrace, b: RoutingTrace, divergences: list[tuple[str, int]]) -> list[str]:
    """For each (request, first differing token): the routing flip at or before it that explains it, checked to be
    a near-tie (AssertionError otherwise, or if no flip precedes it). The bound comes from every request's
    decisions (the diverging ones up to their divergence). One line per divergence."""
    until = {rid: token for rid, token in a.steps}
    for rid, token in a.steps:
        until[rid] = max(until[rid], token)
    until.update(dict(divergences))
    bound, flips = first_flips(a, b, until)
    by_rid = {f.rid: f for f in flips}
    lines = []
    for rid, token in divergences:
        flip = by_rid.get(rid)
        assert flip is not None, f"{rid}: tokens differ from token {token} without a routing flip before: not a " \
                                 "near-tie the router explains"
        limit = bound[flip.stage]
        assert flip.margin <= limit, (
            f"{rid}: first routing flip at token {flip.token}, MoE layer {flip.layer} ({flip.stage}) by a margin of "
            f"{flip.margin:.3e}, more than the largest difference {limit:.3e} at agreeing decisions: not a near-tie")
        lines.append(f"{rid} token {token}: routing flip at token {flip.token}, MoE layer {flip.layer} "
                     f"({flip.stage}), margin {flip.margin:.3e} (bound {limit:.3e})")
    return lines
