"""The routed experts' gate and up as one [E, 2I, H] stack multiplied by one grouped GEMM (decode_server/model/moe.py
`gate_up_stack`): the experts' parameters are views of it, the MoE's output equals gate and up run apart (the CPU
references are exact per element, so bit for bit in FP8), the FP8 warm-up tunes the joined shape, and the cases kept
apart (an FP8 table without the joined shape; intermediate rows not in whole scale blocks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from dsa_test_helpers import small_model

import decode_server.model.moe as moe_module
from decode_server.model import load_model
from decode_server.model.fp8_warmup import fp8_workloads
from decode_server.model.moe import MoE, expert_end_offsets


def _moe(model) -> MoE:
    return next(m for m in model.modules() if isinstance(m, MoE))


def _sorted_rows(moe: MoE, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by expert with the end offsets (some experts with several rows, some with none)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = moe.local_experts()[0].gate_proj.weight.shape[1]
    ids = torch.randint(0, moe.num_local_experts - 2, (tokens,), generator=gen).sort().values
    return torch.randn(tokens, hidden, generator=gen), expert_end_offsets(ids, moe.num_local_experts)


@pytest.fixture()
def tiny_fp8_moe() -> MoE:
    model, _ = load_model("tiny-dsa", "cpu", torch.float32, quantization="fp8")
    return _moe(model)


def test_fp8_experts_share_one_gate_up_stack(tiny_fp8_moe: MoE) -> None:
    moe = tiny_fp8_moe
    joint = moe.gate_up_stack()
    assert joint is not None
    weight, scale = joint
    experts = moe.local_experts()
    inter, hidden = experts[0].gate_proj.weight.shape
    assert tuple(weight.shape) == (len(experts), 2 * inter, hidden)
    assert tuple(scale.shape) == (len(experts), 2 * inter // 128, hidden // 128)
    for e, expert in enumerate(experts):
        for name, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))):
            linear = getattr(expert, name)
            assert linear.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr(), name
            assert torch.equal(linear.weight.view(torch.uint8), weight[e, rows].view(torch.uint8)), name
            assert torch.equal(linear.weight_scale_inv, scale[e, rows.start // 128 : rows.stop // 128]), name
    assert [tuple(w.shape) for w, _ in moe.grouped_gemms()] == [(len(experts), 2 * inter, hidden),
                                                               (len(experts), hidden, inter)]
    kinds = [(kind, tuple(weights[0][0].shape)) for kind, weights, *_ in fp8_workloads(moe)]
    assert ("grouped", (len(experts), 2 * inter, hidden)) in kinds
    assert ("grouped", (len(experts), inter, hidden)) not in kinds  # gate and up are not tuned apart


def test_fp8_joined_gate_up_gives_the_separate_gemms_bits(tiny_fp8_moe: MoE,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    moe = tiny_fp8_moe
    x, offsets = _sorted_rows(moe, 11, seed=3)
    joined = moe.expert_mlps(x, offsets)
    monkeypatch.setattr(MoE, "_joins_gate_up", staticmethod(lambda experts: False))
    moe._stacked = moe._stack(copy=True)  # the same values, gate and up in stacks of their own
    assert moe.gate_up_stack() is None and len(moe.grouped_gemms()) == 3
    apart = moe.expert_mlps(x, offsets)
    assert torch.equal(joined[: int(offsets[-1])], apart[: int(offsets[-1])])


def test_bf16_joined_gate_up_matches_the_separate_gemms(monkeypatch: pytest.MonkeyPatch) -> None:
    moe = _moe(small_model(torch.bfloat16, seed=4))
    assert moe.gate_up_stack() is not None  # unquantized weights always join
    x, offsets = _sorted_rows(moe, 9, seed=5)
    x = x.to(torch.bfloat16)
    joined = moe.expert_mlps(x, offsets).float()
    monkeypatch.setattr(MoE, "_joins_gate_up", staticmethod(lambda experts: False))
    moe._stacked = moe._stack(copy=True)
    apart = moe.expert_mlps(x, offsets).float()
    rows = int(offsets[-1])
    torch.testing.assert_close(joined[:rows], apart[:rows], rtol=2e-2, atol=2e-2)


def test_a_replaced_parameter_restacks_gate_and_up_together(tiny_fp8_moe: MoE) -> None:
    moe = tiny_fp8_moe
    expert = moe.local_experts()[0]  # `stacked` checks the first expert's parameters (a reload replaces them all)
    new_up = expert.up_proj.weight.detach().clone()
    new_up.view(torch.uint8)[0, 0] ^= 0x01
    expert.up_proj.weight = torch.nn.Parameter(new_up, requires_grad=False)  # a reload that assigns a new tensor
    weight, _ = moe.gate_up_stack()
    inter = expert.gate_proj.weight.shape[0]
    assert expert.up_proj.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    assert torch.equal(weight[0, inter:].view(torch.uint8), new_up.view(torch.uint8))


def _expert(rows: int, fp8: bool, device: str = "cpu") -> SimpleNamespace:
    gate = SimpleNamespace(weight=SimpleNamespace(shape=(rows, 256), device=torch.device(device)),
                           fp8_scale=object() if fp8 else None, weight_block=(128, 128))
    return SimpleNamespace(gate_proj=gate)


def test_fp8_joins_only_whole_scale_blocks_with_a_tuned_joined_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    experts = tuple(_expert(256, fp8=True, device="cuda") for _ in range(4))
    asked: list[tuple] = []
    monkeypatch.setattr(moe_module, "grouped_shape_tuned",
                        lambda n, k, e, device: asked.append((n, k, e, device.type)) or False)
    assert not MoE._joins_gate_up(experts) and asked == [(512, 256, 4, "cuda")]
    monkeypatch.setattr(moe_module, "grouped_shape_tuned", lambda n, k, e, device: True)
    assert MoE._joins_gate_up(experts)
    assert not MoE._joins_gate_up(tuple(_expert(192, fp8=True) for _ in range(4)))  # gate ends mid scale block
    assert MoE._joins_gate_up(tuple(_expert(192, fp8=False) for _ in range(4)))  # bf16: no blocks to line up
