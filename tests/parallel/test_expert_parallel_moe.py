"""Expert-parallel MoE on one process: each rank's partial (its own experts' choices only) — by the per-expert
loop (CPU) and by the grouped GEMM (the CUDA path, run here on CPU in bf16) — and the ranks' partials sum to
the single-device routed output. No communication is needed to compute a partial, so no process group."""

from __future__ import annotations

import pytest
import torch

from decode_server.model import load_config
from decode_server.model.construct import piece
from decode_server.model.moe import MoE
from decode_server.parallel.layers import parameter_shards
from decode_server.parallel.state import ParallelState

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
WORLD = 2


def _moes() -> tuple[MoE, list[MoE]]:
    config = load_config("tiny-dsa")
    torch.manual_seed(0)
    whole = MoE(config)
    with torch.no_grad():
        for p in whole.parameters():
            p.normal_(std=0.05)
        whole.gate.e_score_correction_bias.normal_()
    whole = whole.to(torch.bfloat16)
    full = whole.state_dict()
    ranks = []
    for rank in range(WORLD):
        moe = MoE(config, ParallelState(rank, WORLD, WORLD)).to(torch.bfloat16)
        shards = parameter_shards(moe)  # the shared experts are tensor-sharded
        moe.load_state_dict({k: piece(full[k], shards.get(k)) for k in moe.state_dict()}, strict=True)
        ranks.append(moe)
    return whole, ranks


def test_expert_parallel_partials_sum_to_the_single_device_output() -> None:
    whole, ranks = _moes()
    x = torch.randn(41, whole.experts[0].gate_proj.in_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        weights, ids = whole.gate(x)
        want = whole.routed_loop(x, weights, ids).float()
        loops, groupeds = [], []
        for moe in ranks:
            local_ids, owned = moe.local_choices(ids)
            assert owned.any() and not owned.all(), "each rank should own some choices and not others"
            loops.append(moe.routed_loop(x, weights, local_ids).float())
            groupeds.append(moe.routed_grouped(x, weights, local_ids, owned).float())
    for got in (sum(loops), sum(groupeds)):
        rel = (got - want).norm() / want.norm()
        assert rel < 1e-2, f"relative error {rel:.3e}"  # bf16 (same bound as tests/model/test_moe_grouped.py)
    for loop, grouped in zip(loops, groupeds, strict=True):
        # Rows of the grouped GEMM output for other ranks' choices are undefined; they must be masked out.
        assert torch.isfinite(grouped).all()
        assert (grouped - loop).norm() / loop.norm() < 1e-2
