"""The routing near-tie check that explains diverging greedy tokens between two runs of the same requests
(tests/hisparse/routing_ties.py, used by the GPU test of CUDA graphs on vs off): it must accept a flip at a
near-tie, refuse a flip by a clear margin and a divergence no flip explains, and record real engine steps."""

from __future__ import annotations

import pytest
import torch
from harness import Arrival, make_engine, random_prompt, run_script
from routing_ties import Decision, RoutingTrace, explain_divergences, first_flips, record_routing

from decode_server.model import Tokenizer, load_model, resolve_model_path


def _trace(seed: int, flip_token: int | None, gap: float, noise: float = 1e-3) -> RoutingTrace:
    """Request r0, 4 tokens, 2 MoE layers, 8 experts in 4 groups of 2 (2 kept), top-2. Scores get noise up to
    `noise` (another seed: another run). At `flip_token`, layer 1, group 2 (experts 4, 5) rates `gap` above group 3
    (a negative gap: below), both without noise, so two traces of opposite gaps flip there by a margin of |gap|."""
    trace = RoutingTrace(n_group=4, topk_group=2)
    gen = torch.Generator().manual_seed(seed)
    for token in range(4):
        layers = []
        for layer in range(2):
            scores = torch.tensor([0.9, 0.8, 0.1, 0.1, 0.5, 0.5, 0.3, 0.3]) + noise * torch.rand(8, generator=gen)
            if token == flip_token and layer == 1:
                scores[4:8] = torch.tensor([0.5, 0.5, 0.5, 0.5])
                scores[4:6] += gap / 2
            ratings = scores.view(4, 2).sum(-1)
            mask = torch.full_like(scores, float("-inf"))
            for g in ratings.topk(2).indices.tolist():
                mask[2 * g : 2 * g + 2] = 0
            layers.append(Decision(scores, frozenset((scores + mask).topk(2).indices.tolist())))
        trace.steps["r0", token] = layers
    return trace


def test_a_flip_within_the_measured_noise_explains_the_divergence() -> None:
    a, b = _trace(1, 2, gap=1e-4), _trace(2, 2, gap=-1e-4)
    bound, flips = first_flips(a, b, {"r0": 3})
    assert [(f.rid, f.token, f.layer, f.stage) for f in flips] == [("r0", 2, 1, "groups")]
    assert 0 < flips[0].margin <= bound["groups"]
    assert "routing flip at token 2, MoE layer 1" in explain_divergences(a, b, [("r0", 3)])[0]


def test_a_flip_by_a_clear_margin_is_not_a_near_tie() -> None:
    a, b = _trace(1, 2, gap=0.2), _trace(2, 2, gap=-0.2)
    with pytest.raises(AssertionError, match="not a near-tie"):
        explain_divergences(a, b, [("r0", 3)])


def test_a_divergence_without_a_flip_is_not_explained() -> None:
    a, b = _trace(1, None, gap=0.0), _trace(2, None, gap=0.0)
    with pytest.raises(AssertionError, match="without a routing flip"):
        explain_divergences(a, b, [("r0", 3)])


def test_record_routing_files_every_decode_step() -> None:
    model, config = load_model("tiny-dsa", "cpu", torch.float32)
    tiny = (model, config, Tokenizer.from_dir(resolve_model_path("tiny-dsa")))
    engine = make_engine(tiny, hisparse=False)
    trace, remove = record_routing(engine, model)
    gen = torch.Generator().manual_seed(3)
    arrivals = [Arrival(0, "a", random_prompt(gen, 40), 5), Arrival(1, "b", random_prompt(gen, 30), 4)]
    try:
        result = run_script(engine, arrivals)
    finally:
        remove()
    moe_layers = config.num_hidden_layers - config.first_k_dense_replace
    # Token 0 comes from the prefill; every later token from one decode step with one decision per MoE layer.
    assert sorted(trace.steps) == sorted((rid, i) for rid, toks in result.tokens.items() for i in range(1, len(toks)))
    for layers in trace.steps.values():
        assert len(layers) == moe_layers
        assert all(len(d.experts) == config.num_experts_per_tok and d.scores.shape == (config.n_routed_experts,)
                   for d in layers)
    bound, flips = first_flips(trace, trace, {rid: len(toks) for rid, toks in result.tokens.items()})
    assert flips == [] and bound == {"groups": 0.0, "experts": 0.0}
