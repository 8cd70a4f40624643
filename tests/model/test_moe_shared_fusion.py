"""Shared-experts fusion (decode_server/model/moe.py): the shared expert as the last expert of the routed stacks.

On the CPU the MoE never fuses (its path is the per-expert loop), so these tests force the decision where they need
a fused layer: the shared expert's parameters become views of the stacks' last expert and load through them; the
sorted grouped path with the shared expert as each token's extra choice equals the unfused layer (CPU references:
exact per element); the FP8 warm-up plans the E+1 shapes at (experts per token + 1) rows a token; and the decision
itself — EP, the switch, a table without the E+1 shapes, shapes that differ — on the meta device (as on a GPU).
The dispatch and combine kernels' fused form is checked under the Triton interpreter (triton_cpu_checks.py
`interpret-moe-dispatch`) and on the GPU (test_moe_dispatch_gpu.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import decode_server.model.moe as moe_module
from decode_server.model import load_config, load_model
from decode_server.model.construct import build_empty_model
from decode_server.model.fp8_warmup import fp8_workloads, table_keys
from decode_server.model.moe import MoE
from decode_server.parallel.state import ParallelState


def _moes(model) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


@pytest.fixture()
def fused_and_plain(monkeypatch: pytest.MonkeyPatch):
    """tiny-dsa with FP8 weights on the CPU loaded twice from its checkpoint: shared expert fused, and not."""
    plain, _ = load_model("tiny-dsa", "cpu", torch.float32, quantization="fp8")
    monkeypatch.setattr(MoE, "_can_fuse_shared", lambda self: True)
    fused, _ = load_model("tiny-dsa", "cpu", torch.float32, quantization="fp8")
    return fused, plain


def test_cpu_layers_do_not_fuse() -> None:
    model, _ = load_model("tiny-dsa", "cpu", torch.float32, quantization="fp8")
    for moe in _moes(model):
        assert not moe.fuses_shared and moe.stack_members() == moe.local_experts()
        assert moe.shared_experts.fused_gate_up is not None  # its own [gate ; up] stack, as a dense MLP


def test_the_shared_expert_is_the_stacks_last_expert(fused_and_plain) -> None:
    fused, plain = fused_and_plain
    for moe, ref in zip(_moes(fused), _moes(plain), strict=True):
        assert moe.fuses_shared and moe.stack_members()[-1] is moe.shared_experts
        assert moe.shared_experts.fused_gate_up is None  # no second stack of its own
        (joint_w, joint_s), (down_w, down_s) = moe.grouped_gemms()
        experts = moe.num_local_experts
        inter, hidden = moe.shared_experts.gate_proj.weight.shape
        assert tuple(joint_w.shape) == (experts + 1, 2 * inter, hidden)
        assert tuple(down_w.shape) == (experts + 1, hidden, inter)
        shared = moe.shared_experts
        for name, whole, rows in (("gate_proj", joint_w, slice(0, inter)), ("up_proj", joint_w, slice(inter, None)),
                                  ("down_proj", down_w, slice(None))):
            weight = getattr(shared, name).weight
            assert weight.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr(), name
            # Loaded through the views: the checkpoint's values, as the unfused layer holds them.
            expected = getattr(ref.shared_experts, name).weight
            assert torch.equal(whole[experts, rows].view(torch.uint8), expected.view(torch.uint8)), name
        assert torch.equal(joint_s[experts, : inter // 128], ref.shared_experts.gate_proj.weight_scale_inv)
        assert torch.equal(down_s[experts], ref.shared_experts.down_proj.weight_scale_inv)
        for e in range(experts):  # the routed experts are where they were
            assert torch.equal(joint_w[e, :inter].view(torch.uint8),
                               ref.local_experts()[e].gate_proj.weight.view(torch.uint8))


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_fused_grouped_path_equals_routed_plus_shared(fused_and_plain, tokens: int) -> None:
    fused, plain = fused_and_plain
    moe, ref = _moes(fused)[0], _moes(plain)[0]
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, moe.shared_experts.gate_proj.weight.shape[1], generator=gen)
    weights, ids = ref.gate(x)
    got = moe.routed_grouped(x, weights, ids)
    want = ref.routed_grouped(x, weights, ids) + ref.shared_experts(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # The layer's CPU path (per-expert loop + the shared MLP through its views) is unchanged by the fusion.
    assert torch.equal(moe(x), ref(x))


def test_warm_up_plans_the_extra_row_per_token(fused_and_plain) -> None:
    fused, plain = fused_and_plain
    experts = _moes(fused)[0].num_local_experts
    grouped = [(tuple(w[0][0].shape), extra) for kind, w, _, extra in fp8_workloads(fused) if kind == "grouped"]
    assert grouped and all(shape[0] == experts + 1 and extra == 1 for shape, extra in grouped)
    top_k = 2  # tiny-dsa
    fused_buckets = {key[4] for key in table_keys(fused, [1, 2, 5], top_k) if key[0] == "grouped"}
    plain_buckets = {key[4] for key in table_keys(plain, [1, 2, 5], top_k) if key[0] == "grouped"}
    assert fused_buckets == {4, 8, 16}  # 3, 6 and 15 rows
    assert plain_buckets == {2, 4, 16}  # 2, 4 and 10 rows


def test_warm_up_times_grouped_gemms_on_decode_routing(fused_and_plain, monkeypatch) -> None:
    """The warm-up tells the tuner how decode routes each grouped GEMM's rows: the experts per token, and the
    shared expert's row where it is fused (kernels/fp8_gemm.py `grouped_routing_samples`); dense and batched
    shapes get no routing."""
    import decode_server.model.fp8_warmup as warmup
    from kernels.fp8_gemm import Routing

    asked: list[tuple] = []
    monkeypatch.setattr(warmup, "tune", lambda kind, weights, m, dtype, block, routing=None:
                        asked.append((kind, tuple(weights[0][0].shape), m, routing)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    fused, plain = fused_and_plain
    for model, shared in ((fused, True), (plain, False)):
        asked.clear()
        warmup.warm_up(model, [1, 5], 2)
        grouped = [a for a in asked if a[0] == "grouped"]
        assert grouped and all(a[3] == Routing(2, shared) for a in grouped)
        assert all(a[3] is None for a in asked if a[0] != "grouped")


def _decide(monkeypatch: pytest.MonkeyPatch, config_name: str = "tiny-dsa", tp: int = 1, ep: int = 1,
            tuned: bool = True, config=None) -> tuple[list[bool], list[tuple]]:
    """Build on the meta device (a GPU's decisions without one) and report each MoE's choice, and the grouped
    shapes it asked the table for."""
    asked: list[tuple] = []
    monkeypatch.setattr(moe_module, "grouped_shape_tuned",
                        lambda n, k, e, device: asked.append((n, k, e)) or tuned)
    config = config or load_config(config_name)
    model = build_empty_model(config, "meta", torch.bfloat16, ParallelState(tp_rank=0, tp_size=tp, ep_size=ep),
                              fp8=True)
    return [m.fuses_shared for m in _moes(model)], asked


def test_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    fused, asked = _decide(monkeypatch)
    assert fused and all(fused)
    assert (256, 256, 9) in asked and (256, 128, 9) in asked  # [gate ; up] and down of 8 experts + the shared
    fused, _ = _decide(monkeypatch, tuned=False)  # the GPU's table lacks the E+1 shapes
    assert not any(fused)
    fused, _ = _decide(monkeypatch, "deepseek-v3.2", tp=8, ep=8)  # EP: whole experts, a sharded shared expert
    assert not any(fused)
    fused, _ = _decide(monkeypatch, "deepseek-v3.2", tp=8, ep=1)  # TP: both sharded alike
    assert all(fused)
    wide = dataclasses.replace(load_config("tiny-dsa"), n_shared_experts=2)  # shared expert twice as wide
    fused, _ = _decide(monkeypatch, config=wide)
    assert not any(fused)
    moe_module.set_shared_experts_fusion(False)
    try:
        fused, _ = _decide(monkeypatch)
        assert not any(fused)
    finally:
        moe_module.set_shared_experts_fusion(True)


def test_engine_flag_reaches_the_model() -> None:
    from decode_server.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["serve", "--disable-shared-experts-fusion"])
    assert engine_config_from_args(args).disable_shared_experts_fusion
    args = build_parser().parse_args(["serve"])
    assert not engine_config_from_args(args).disable_shared_experts_fusion
