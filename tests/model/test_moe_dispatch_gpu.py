"""The MoE's one-kernel dispatch and combine on the GPU (kernels/moe_dispatch_triton.py) against the eager path
they replace at decode batch sizes (decode_server/model/moe.py `MoE.routed_grouped`).

- dispatch: the same rows in the same order as the stable sort, and the same end offsets, for DeepSeek-V3.2's
  router shape (256 experts, top-8) at 1–512 tokens, with expert parallelism's sentinel ids;
- combine: the float32 sum in expert-slot order bit for bit, eager's `sum(dim=1)` within float32 rounding, and the
  shared experts' add as eager's bf16 add;
- a whole MoE layer (bf16 and FP8 experts, under CUDA-graph replay too): within float32 summation order of the
  eager path's output (the experts' GEMMs see the same rows, so only the combine's sum order differs).

Run: pytest -m gpu tests/model/test_moe_dispatch_gpu.py -v
"""

from __future__ import annotations

import pytest
import torch

from decode_server.model import moe as moe_module
from decode_server.model.moe import expert_end_offsets

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("tokens", [1, 2, 16, 64, 512])
@pytest.mark.parametrize("cut", [None, 32], ids=["all-local", "ep-32-of-256"])
def test_dispatch_and_combine_against_the_eager_path(tokens: int, cut: int | None) -> None:
    from kernels import moe_dispatch_triton as k

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    experts, top_k, hidden = 256, 8, 7168
    ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=-1).indices
    local = experts
    if cut is not None:
        ids, local = torch.where(ids < cut, ids, cut), cut
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    xs, slot, ends = k.dispatch(x, ids, local)
    sorted_ids, order = torch.sort(ids.flatten(), stable=True)
    assert torch.equal(ends, expert_end_offsets(sorted_ids, local))
    assert torch.equal(xs, x[order // top_k])
    assert torch.equal(order[slot.long()], torch.arange(ids.numel(), device="cuda"))
    ys = torch.randn(ids.numel(), hidden, device="cuda", generator=gen).to(torch.bfloat16)
    weights = torch.rand(tokens, top_k, device="cuda", generator=gen)
    shared = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    per_choice = torch.where((ids < local).unsqueeze(-1), ys[slot.long()].view(tokens, top_k, -1).float(), 0.0)
    per_choice = per_choice * weights.unsqueeze(-1)
    ordered = torch.zeros(tokens, hidden, device="cuda")
    for j in range(top_k):
        ordered += per_choice[:, j]
    got = k.combine(ys, slot, ids, weights, local, out_dtype=torch.float32)
    assert torch.equal(got, ordered)
    torch.testing.assert_close(got, per_choice.sum(dim=1), rtol=2e-6, atol=1e-5)
    with_shared = k.combine(ys, slot, ids, weights, local, shared=shared, out_dtype=torch.bfloat16)
    assert torch.equal(with_shared, ordered.to(torch.bfloat16) + shared)


def _replayed(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """layer(x) captured in a CUDA graph on a side stream and replayed once."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=stream):
        out = layer(x)
    graph.replay()
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_moe_layer_dispatched_equals_the_sorted_path(quantization: str, monkeypatch) -> None:
    from decode_server.model import build_random_model, load_config

    config = load_config("tiny-dsa")
    model = build_random_model(config, "cuda", torch.bfloat16, seed=0, quantization=quantization)
    layer = next(m for m in model.modules() if isinstance(m, moe_module.MoE))
    x = (torch.randn(16, config.hidden_size, device="cuda") * 0.5).to(torch.bfloat16)
    fused = layer(x)
    assert torch.equal(_replayed(layer, x), fused)
    monkeypatch.setattr(moe_module, "moe_dispatch_supported", lambda *args: False)
    eager = layer(x)
    # The same expert outputs; only the weighted sum's order differs (float32), then one bf16 rounding each.
    scale = eager.float().abs().max()
    assert (fused.float() - eager.float()).abs().max() <= 2.0**-7 * scale
    assert (fused != eager).float().mean() < 0.01


def test_fused_shared_expert_matches_the_separate_gemms(monkeypatch) -> None:
    """Shared-experts fusion (decode_server/model/moe.py) on the GPU: tiny-dsa's FP8 MoE layer with the shared
    expert as each token's extra choice of the grouped GEMMs (forced: the shipped tables hold no tiny shapes)
    against the same weights with the shared expert's own dense GEMMs — within the rounding of two FP8 kernels'
    different accumulation orders — at decode's token counts, equal to itself under CUDA-graph replay, and the
    sorted path (larger batches) within the combine's float32 sum order of the one-kernel dispatch."""
    from decode_server.model import build_random_model, load_config

    config = load_config("tiny-dsa")
    # The reference never fuses, whatever tuning mode an earlier test left (measure mode would let it).
    monkeypatch.setattr(moe_module, "_shared_experts_fusion", False)
    plain = next(m for m in build_random_model(config, "cuda", torch.bfloat16, seed=0, quantization="fp8").modules()
                 if isinstance(m, moe_module.MoE))
    monkeypatch.setattr(moe_module, "_shared_experts_fusion", True)
    monkeypatch.setattr(moe_module, "grouped_shape_tuned", lambda *args: True)
    layer = next(m for m in build_random_model(config, "cuda", torch.bfloat16, seed=0, quantization="fp8").modules()
                 if isinstance(m, moe_module.MoE))
    assert layer.fuses_shared and not plain.fuses_shared
    assert torch.equal(layer.shared_experts.down_proj.weight.view(torch.uint8),
                       plain.shared_experts.down_proj.weight.view(torch.uint8))
    gen = torch.Generator(device="cuda").manual_seed(1)
    for tokens in (1, 16, 64):
        x = (torch.randn(tokens, config.hidden_size, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        got, want = layer(x), plain(x)
        scale = want.float().abs().max()
        assert (got.float() - want.float()).abs().max() <= 2.0**-5 * scale, tokens
        assert torch.equal(_replayed(layer, x), got), tokens
        with monkeypatch.context() as m:
            m.setattr(moe_module, "moe_dispatch_supported", lambda *args: False)
            sorted_path = layer(x)
        assert (sorted_path.float() - got.float()).abs().max() <= 2.0**-7 * scale, tokens
