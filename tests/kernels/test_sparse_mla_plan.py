"""Launch planning of the sparse MLA decode (no GPU needed): the split cost model and the per-shape choice
between FlashMLA and our own kernel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kernels.sparse_mla_plan import FLASHMLA_MIN_BATCH, choose_splits, prefer_flashmla, split_cost_us


def test_choose_splits_divides_the_tiles_and_picks_the_least_cost() -> None:
    for fp8 in (False, True):
        for heads, block_h in ((128, 64), (64, 64), (16, 16)):
            for batch in (1, 3, 16, 64, 237, 256):
                s = choose_splits(batch, heads, 2048, block_h, 64, 132, fp8)
                assert 32 % s == 0
                costs = {d: split_cost_us(batch, heads, 2048, block_h, 64, 132, fp8, d) for d in (1, 2, 4, 8, 16, 32)}
                assert costs[s] == min(costs.values())


def test_partial_output_traffic_keeps_large_batches_unsplit() -> None:
    """Issue 13: the old model split a batch of 237 (and 50) 32 ways; the fp32 partials it wrote and read back
    cost more than the idle SMs they filled."""
    for fp8 in (False, True):
        assert choose_splits(237, 128, 2048, 64, 64, 132, fp8) == 1
        assert choose_splits(256, 128, 2048, 64, 64, 132, fp8) == 1
        assert choose_splits(1, 128, 2048, 64, 64, 132, fp8) == 32  # one request: fill the GPU


def test_fp8_rows_split_by_the_model() -> None:
    """FP8 tiles cost ~1.5× a bf16 tile since they are dequantized as they load, so the model, not a rule of their
    own, picks their split: H200 sweep 2026-11-28, H 128 batch 3: 16 splits 27.2 µs, 32 splits 32.2 µs; batch 1: 32
    splits 19.9 µs."""
    assert choose_splits(3, 128, 2048, 64, 64, 132, True) == 16
    assert choose_splits(1, 128, 2048, 64, 64, 132, True) == 32


def test_prefer_flashmla_only_where_measured_faster() -> None:
    for (heads, fp8), threshold in FLASHMLA_MIN_BATCH.items():
        assert not prefer_flashmla(threshold - 1, heads, fp8)
        assert prefer_flashmla(threshold, heads, fp8) and prefer_flashmla(512, heads, fp8)
    assert not prefer_flashmla(256, 16, False)  # FlashMLA takes 64 or 128 heads only


def test_gluon_splits_use_the_gluon_costs() -> None:
    """The Gluon kernel's tiles are cheaper, so its model is its own; unknown kernels are refused."""
    for fp8 in (False, True):
        for batch in (1, 3, 16, 64, 256):
            s = choose_splits(batch, 128, 2048, 64, 64, 132, fp8, kernel="gluon")
            costs = {d: split_cost_us(batch, 128, 2048, 64, 64, 132, fp8, d, "gluon") for d in (1, 2, 4, 8, 16, 32)}
            assert costs[s] == min(costs.values())
        assert split_cost_us(64, 128, 2048, 64, 64, 132, fp8, 1, "gluon") < split_cost_us(64, 128, 2048, 64, 64, 132,
                                                                                           fp8, 1)
    with pytest.raises(ValueError, match="unknown sparse MLA kernel"):
        choose_splits(1, 128, 2048, 64, 64, 132, kernel="cutlass")


def test_gluon_kernel_only_on_hopper_launches() -> None:
    """On a CPU tensor (and so in CI) the Gluon kernel never applies: the reference or Triton runs."""
    from kernels.sparse_mla_gluon import gluon_applies

    q = torch.zeros(2, 128, 576, dtype=torch.bfloat16)
    kv = torch.zeros(100, 576, dtype=torch.bfloat16)
    assert not gluon_applies(q, kv, torch.zeros(2, 2048, dtype=torch.int32))


def test_gluon_takes_a_tp_ranks_heads_where_measured_faster() -> None:
    """64-head multiples always; a TP rank's 32 heads in both row formats, 16 only with FP8 rows (bf16 rows at 16
    heads ran faster through the Triton kernel from batch 64); other counts never (the kernel cannot pad them)."""
    from kernels.sparse_mla_gluon import gluon_takes_heads

    for fp8 in (False, True):
        assert gluon_takes_heads(64, fp8) and gluon_takes_heads(128, fp8) and gluon_takes_heads(32, fp8)
        assert not any(gluon_takes_heads(h, fp8) for h in (0, 8, 24, 48, 96))
    assert gluon_takes_heads(16, True) and not gluon_takes_heads(16, False)


def test_gluon_split_choice_near_the_measured_best() -> None:
    """Replays the Gluon kernel's recorded split sweeps (every split count timed at every batch, H100 and H200,
    benchmarks/results/sparse_mla_gluon_prefetch_2026-11-28): the modelled choice is never more than 7 % slower than
    the best measured split, and within 0.5 % on average."""
    folder = Path(__file__).resolve().parents[2] / "benchmarks/results/sparse_mla_gluon_prefetch_2026-11-28"
    ratios = []
    for path in sorted(folder.glob("h*_splits_gluon.json")):
        for row in json.loads(path.read_text())["split_sweep"]:
            if row.get("kernel") != "gluon":
                continue
            times = {int(k): v for k, v in row["times_us"].items()}
            chosen = choose_splits(row["batch"], row["heads"], 2048, 64, 64, 132, row["fmt"] == "fp8", "gluon")
            ratios.append(times[chosen] / min(times.values()))
    assert len(ratios) >= 100  # both GPUs' sweeps
    assert max(ratios) <= 1.07
    assert sum(ratios) / len(ratios) <= 1.005
