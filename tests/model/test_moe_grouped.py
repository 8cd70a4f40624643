"""The grouped-GEMM MoE path (used on CUDA: no host sync) equals the per-expert loop."""

from __future__ import annotations

import pytest
import torch

from decode_server.model import load_config
from decode_server.model.moe import MoE

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")


def _moe(device: str) -> MoE:
    cfg = load_config("tiny-dsa")
    torch.manual_seed(0)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=0.05)
        moe.gate.e_score_correction_bias.normal_()
    return moe.to(device=device, dtype=torch.bfloat16)


def _check(device: str) -> None:
    moe = _moe(device)
    x = torch.randn(41, moe.experts[0].gate_proj.in_features, dtype=torch.bfloat16, device=device)
    with torch.inference_mode():
        weights, ids = moe.gate(x)
        loop = moe.routed_loop(x, weights, ids).float()
        grouped = moe.routed_grouped(x, weights, ids).float()
        again = moe.routed_grouped(x, weights, ids).float()
    assert torch.equal(grouped, again)  # deterministic: no atomics in the combine
    rel = (grouped - loop).norm() / loop.norm()
    assert rel < 1e-2, f"relative error {rel:.3e}"
    # The stacked weights are views: each expert's parameter shares storage with the stack.
    gate_w = moe.stacked_weights()[0]
    assert moe.experts[3].gate_proj.weight.data_ptr() == gate_w[3].data_ptr()


def test_grouped_moe_equals_loop_cpu() -> None:
    _check("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_moe_equals_loop_gpu() -> None:
    _check("cuda")
