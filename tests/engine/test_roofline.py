"""The decode step's roofline floor (benchmarks/roofline.py, issue 22): known bytes give known floors, and the
weight split of a built model adds up to its stored bytes."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest
import torch

from decode_server.model import build_random_model, load_config
from decode_server.model.construct import build_empty_model
from decode_server.model.weights import weight_bytes

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("roofline", ROOT / "benchmarks" / "roofline.py")
roofline = importlib.util.module_from_spec(_spec)
sys.modules["roofline"] = roofline  # dataclasses look their module up there
_spec.loader.exec_module(roofline)


def test_expected_active_experts_formula_and_limits():
    assert roofline.expected_active_experts(32, 8, 1) == pytest.approx(8.0)
    assert roofline.expected_active_experts(32, 8, 2) == pytest.approx(32 * (1 - 0.75**2))  # 14.0
    assert roofline.expected_active_experts(32, 8, 2) == pytest.approx(14.0)
    assert roofline.expected_active_experts(32, 8, 64) == pytest.approx(32.0, abs=1e-6)
    assert roofline.expected_active_experts(16, 8, 3) == pytest.approx(14.0)  # 16 · (1 − 1/8)
    assert roofline.expected_active_experts(32, 8, 0) == 0.0
    with pytest.raises(ValueError):
        roofline.expected_active_experts(4, 8, 1)


def test_expected_active_experts_matches_sampling():
    """The formula against sampled routing (each token: 8 distinct of 32 uniformly)."""
    rng = random.Random(0)
    for batch in (1, 3, 10):
        trials = 3000
        mean = sum(len({e for _ in range(batch) for e in rng.sample(range(32), 8)}) for _ in range(trials)) / trials
        assert mean == pytest.approx(roofline.expected_active_experts(32, 8, batch), rel=0.02)


def _split(**kw):
    base = dict(fixed=1000, routed_expert=100, moe_layers=2, experts_per_layer=4, experts_per_token=2,
                embedding_row=10, vocab_rows=50, unread=7)
    return roofline.WeightSplit(**{**base, **kw})


def test_weight_bytes_read_counts_activated_experts_only():
    split = _split()
    assert split.total == 1000 + 100 * 2 * 4 + 10 * 50 + 7
    # batch 1: 2 of 4 experts per layer, one embedding row
    assert roofline.weight_bytes_read(split, 1) == pytest.approx(1000 + 10 + 100 * 2 * 2)
    # batch 2: 4 · (1 − (1/2)²) = 3 experts per layer
    assert roofline.weight_bytes_read(split, 2) == pytest.approx(1000 + 20 + 100 * 2 * 3)
    dense_only = _split(moe_layers=0, experts_per_layer=0, experts_per_token=0)
    assert roofline.weight_bytes_read(dense_only, 5) == 1000 + 50


def test_kv_bytes_read():
    # 2 requests, 4 layers of 656 B rows reading min(2048, 32768) rows, 4 indexer layers of 132 B keys
    assert roofline.kv_bytes_read(2, 32768, 4, 4, 2048, 656, 132) == 2 * (4 * 2048 * 656 + 4 * 32768 * 132)
    # short context: attention reads every row (fewer than top-k); GLM-5 shared layers: fewer indexer layers
    assert roofline.kv_bytes_read(1, 1000, 78, 21, 2048, 656, 132) == 78 * 1000 * 656 + 21 * 1000 * 132


def test_step_floor_adds_hbm_and_pcie_terms():
    floor = roofline.step_floor(weight_bytes=3e9, kv_bytes=1e9, miss_bytes=5e8, hbm_gbps=4000, pcie_gbps=50)
    assert floor.hbm_s == pytest.approx(1e-3)
    assert floor.pcie_s == pytest.approx(1e-2)
    assert floor.seconds == pytest.approx(11e-3)
    dense = roofline.step_floor(3e9, 1e9, 0, 4000, 0)  # no misses: PCIe bandwidth is not needed
    assert dense.seconds == pytest.approx(1e-3) and dense.pcie_s == 0
    with pytest.raises(ValueError):
        roofline.step_floor(1, 1, 1, 4000, 0)


def test_weight_split_of_a_built_model_adds_up():
    """tiny-dsa on CPU: the split's total is the model's stored weight bytes, kv_b_proj is unread, the stacked
    experts divide evenly per expert."""
    config = load_config("tiny-dsa")
    model = build_random_model(config, "cpu")
    split = roofline.weight_split(model)
    assert split.total == weight_bytes(model)["total"]
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    assert (split.moe_layers, split.experts_per_layer, split.experts_per_token) == (
        moe_layers, config.n_routed_experts, config.num_experts_per_tok)
    kv_b = sum(t.untyped_storage().nbytes() for n, t in model.state_dict().items() if ".kv_b_proj." in n)
    assert split.unread == kv_b > 0
    assert split.embedding_row == config.hidden_size * 4  # float32 on CPU


def test_weight_split_of_the_rank_config():
    """dsv32-rank-ep8 (meta: no memory): 58 MoE layers of 32 FP8 experts, top-8; an expert's three FP8 projections
    of 2048 × 7168 plus their block scales."""
    config = load_config("dsv32-rank-ep8")
    model = build_empty_model(config, "meta", torch.bfloat16, fp8=True)
    split = roofline.weight_split(model)
    assert (split.moe_layers, split.experts_per_layer, split.experts_per_token) == (58, 32, 8)
    assert split.routed_expert == 3 * (2048 * 7168 + 16 * 56 * 4)
    assert split.total == weight_bytes(model)["total"]
    # batch 1 reads the fixed part, one embedding row and 8 experts per MoE layer
    assert roofline.weight_bytes_read(split, 1) == pytest.approx(
        split.fixed + split.embedding_row + 58 * 8 * split.routed_expert)


def test_measure_bandwidths_on_cpu():
    bw = roofline.measure_bandwidths(torch.device("cpu"), hbm_bytes=8 << 20, iters=2)
    assert bw["hbm_gbps"] > 0 and bw["pcie_gbps"] > 0 and bw["hbm_method"] == "cpu memcpy"


def test_weight_split_counts_a_fused_shared_expert_as_fixed(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the shared expert fused into the experts' stacks (decode_server/model/moe.py) its bytes share their
    storage but are read every step: the split is the unfused model's."""
    from decode_server.model.moe import MoE

    config = load_config("dsv32-rank-ep8")
    monkeypatch.setattr(MoE, "_can_fuse_shared", lambda self: False)
    plain = roofline.weight_split(build_empty_model(config, "meta", torch.bfloat16, fp8=True))
    monkeypatch.setattr(MoE, "_can_fuse_shared", lambda self: True)
    model = build_empty_model(config, "meta", torch.bfloat16, fp8=True)
    assert all(m.fuses_shared for m in model.modules() if isinstance(m, MoE))
    assert roofline.weight_split(model) == plain
