"""The MoE router's selection as one Triton kernel (kernels/moe_route_triton.py) on the GPU against the eager
reference `route_tokens`: the same experts on rows without near-ties (the sigmoid may differ in its last bit),
weights within float32 rounding, the documented tie rule (lower index first), and CUDA-graph replay giving the
launch's bits. The interpreter check `interpret-moe-route` (tests/kernels/triton_cpu_checks.py) holds the kernel
to the reference exactly on the CPU."""

from __future__ import annotations

import pytest
import torch

from decode_server.model.moe import route_tokens
from kernels import moe_route_triton

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CASES = [  # experts, groups, groups kept, top-k, normalize
    (256, 8, 4, 8, True), (32, 4, 2, 8, True), (64, 1, 1, 6, False), (16, 16, 4, 3, False), (8, 4, 2, 2, True),
]


@pytest.mark.parametrize(("experts", "groups", "kept", "top_k", "normalize"), CASES)
@pytest.mark.parametrize("tokens", [1, 16, 200])
def test_route_kernel_matches_eager(experts: int, groups: int, kept: int, top_k: int, normalize: bool,
                                    tokens: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(experts * 7 + tokens)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen) * 2
    bias = torch.randn(experts, device="cuda", generator=gen) * 0.1
    assert moe_route_triton.supports(logits, groups, kept, top_k)
    want_w, want_ids = route_tokens(logits, bias, groups, kept, top_k, normalize, 2.5)
    got_w, got_ids = moe_route_triton.route(logits, bias, groups, kept, top_k, normalize, 2.5)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32 and got_ids.shape == want_ids.shape
    same = (got_ids == want_ids).all(dim=1)
    assert same.float().mean().item() >= (0.97 if tokens >= 100 else 1.0)
    assert torch.allclose(got_w[same], want_w[same], rtol=1e-5, atol=1e-7)


def test_route_kernel_tie_rule_is_lower_index_first() -> None:
    """All scores equal: the first groups, then the first experts of them, in index order."""
    logits = torch.zeros(3, 256, device="cuda")
    bias = torch.zeros(256, device="cuda")
    weights, ids = moe_route_triton.route(logits, bias, 8, 4, 8, True, 1.0)
    assert ids.tolist() == [list(range(8))] * 3
    assert torch.allclose(weights, torch.full_like(weights, 1 / 8))
    # Groups tie on their rating, experts differ: group 1's better expert comes first, only groups 0-3 are kept.
    logits[:, 40] = 3.0
    logits[:, 200] = 3.0  # group 6 rates higher than groups 2-3 now, so it is kept instead of group 3
    _, ids = moe_route_triton.route(logits, bias, 8, 4, 8, True, 1.0)
    assert ids[0, :2].tolist() == [40, 200] and set(ids[0, 2:].tolist()) == {0, 1, 2, 3, 4, 5}


def test_route_kernel_under_graph_replay() -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(16, 256, device="cuda", generator=gen)
    bias = torch.randn(256, device="cuda", generator=gen) * 0.1
    want = moe_route_triton.route(logits, bias, 8, 4, 8, True, 2.5)
    out_w, out_ids = torch.empty_like(want[0]), torch.empty_like(want[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, ids = moe_route_triton.route(logits, bias, 8, 4, 8, True, 2.5)
        out_w.copy_(w)
        out_ids.copy_(ids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_w, want[0]) and torch.equal(out_ids, want[1])


def test_unsupported_shapes_are_declined() -> None:
    logits = torch.randn(4, 96, device="cuda")  # not a power of two
    assert not moe_route_triton.supports(logits, 4, 2, 8)
    assert not moe_route_triton.supports(torch.randn(4, 256), 8, 4, 8)  # CPU
    assert not moe_route_triton.supports(torch.randn(0, 256, device="cuda"), 8, 4, 8)
