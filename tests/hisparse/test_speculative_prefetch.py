"""Speculative prefetch (HiSparseConfig.speculative_prefetch, decode_server/hisparse/prefetch.py, issue 23 item 3),
on CPU.

- the bet map (full layer → next full layer) for several `indexer_types` patterns;
- tiny-dsa (three full layers) with a device buffer smaller than the prompts, so every layer misses: bets on ==
  bets off == dense, greedy tokens and logits bit for bit; layer 0, which nobody bets on, keeps exactly its
  counters; the bets' own counters saw hits and misses; one bet per decode step and later layer;
- the equality check catches a wrong bet (one that copies another layer's host rows into the buffer);
- the order inside a decode forward: the bet on layer l+1 runs during layer l's attention, after l's own
  swap-in, and before l+1's; with the early swap-in it runs right after l's own on the side stream;
- tiny-glm5 (full, shared, full, shared): the bet goes from full layer 0 to full layer 2, after the shared
  follower's prefetch, and results stay bit for bit those of dense;
- the bets' payoff on tiny-glm5 (`rows_saved_by_bets`): without bets a full layer's counters are exactly its shared
  follower's (the counterfactual the payoff reads), with bets the full layer bet on reports its follower's misses −
  its own, and DSA-only models report none;
- a forward that fails before the layer it bet on leaves nothing pending.
The CUDA side (side stream, events, graphs) is tests/hisparse/test_speculative_prefetch_gpu.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import (
    SMALL_BUFFER_ENGINE,
    Arrival,
    assert_identical,
    long_prompt_workload,
    make_engine,
    random_prompt,
    record_decode_order,
    run_poisoned_modes,
    run_script,
)

from decode_server.engine.kv_rows import CacheGeometry
from decode_server.engine.sampling_params import SamplingParams
from decode_server.hisparse import ops
from decode_server.hisparse.prefetch import SwapInPrefetch, next_full_layers, rows_saved_by_bets
from decode_server.model import Tokenizer, load_model, resolve_model_path
from decode_server.model.config import ModelConfig
from kernels.swap_in_tables import SwapInTables

ROOT = Path(__file__).resolve().parents[2]


def _tiny(name: str):
    model, config = load_model(name, "cpu", torch.float32)
    return model, config, Tokenizer.from_dir(resolve_model_path(name))


@pytest.fixture(scope="module")
def tiny_dsa():
    return _tiny("tiny-dsa")


@pytest.fixture(scope="module")
def tiny_glm5():
    return _tiny("tiny-glm5")


def _workload() -> list[Arrival]:
    return long_prompt_workload(11, (150, 100, 130))


def _geometry(types: str) -> CacheGeometry:
    return CacheGeometry(len(types), index_layers=tuple(i for i, t in enumerate(types) if t == "F"))


@pytest.mark.parametrize(("types", "expected"), [
    ("FFF", {0: 1, 1: 2}),
    ("FSFS", {0: 2}),
    ("FSSSFSSSF", {0: 4, 4: 8}),
    ("F", {}),
    ("SFS", {}),
])
def test_next_full_layers(types: str, expected: dict[int, int]) -> None:
    assert next_full_layers(_geometry(types)) == expected


@pytest.mark.parametrize(("types", "expected"), [
    ("FSFS", {2: 7 - 2}),  # layer 2's follower is layer 3
    ("FSSSFSSSFS", {4: 5 - 4, 8: 9 - 8}),  # the first follower of each later full layer
    ("FSFFS", {3: 4 - 3}),  # full layer 2 is bet on but has no follower: no counterfactual
    ("FFF", {}),  # DeepSeek-V3.2's pattern: no shared layer anywhere
])
def test_rows_saved_by_bets_reads_each_bet_on_layers_first_follower(types: str, expected: dict[int, int]) -> None:
    misses = {"FSFS": [9, 9, 2, 7]}.get(types, list(range(len(types))))
    assert rows_saved_by_bets(misses, _geometry(types)) == expected


def test_glm5_ranks_last_full_layer_is_bet_on_without_a_follower() -> None:
    """`glm5-rank-ep8` (78 layers, full layers 0, 1, 5, ..., 77): bets land on 20 full layers, 19 of which have a
    shared follower to measure them; the last layer's bets copy rows no counterfactual prices. So where every layer
    selects alike, the bets' saved rows are 19/20 of all they copied (the rank bench's 0.95 at C 1.0), and the
    payoff is read against the measured layers' copies (bench_decode's `speculative_rows_measured_per_step`)."""
    geometry = CacheGeometry.from_model_config(ModelConfig.from_json(ROOT / "configs" / "glm5-rank-ep8.json"))
    bet_on = set(next_full_layers(geometry).values())
    measured = set(rows_saved_by_bets([0] * geometry.num_layers, geometry))
    assert len(bet_on) == 20 and bet_on - measured == {77} and measured < bet_on


def _stats(engine) -> list[tuple[int, int, int, int]]:
    return [(s.hits, s.misses, s.speculative_hits, s.speculative_misses) for s in engine.kv.layer_stats()]


def _decode_steps(run) -> int:
    return sum(1 for s in run.schedule if s is not None and s[3])


def test_bets_are_bit_identical_to_dense_and_to_no_bets(tiny_dsa) -> None:
    modes = [("dense", {"hisparse": False}), ("off", {"hisparse": True}),
             ("on", {"hisparse": True, "speculative_prefetch": True})]
    runs, engines = run_poisoned_modes(tiny_dsa, _workload(), modes, graphs=False, **SMALL_BUFFER_ENGINE)
    assert_identical(runs["dense"], runs["off"])
    assert_identical(runs["dense"], runs["on"])
    assert len({tuple(t) for t in runs["dense"].tokens.values()}) == 4  # prompt-dependent outputs
    on, off = _stats(engines["on"]), _stats(engines["off"])
    assert on[0] == off[0], "layer 0 receives no bet: its swap-ins must be exactly those without bets"
    assert on[0][2:] == (0, 0)
    for layer in (1, 2):
        _, _, bet_hits, bet_misses = on[layer]
        assert bet_hits > 0 and bet_misses > 0, f"layer {layer}: the bets never hit or never copied"
        assert off[layer][2:] == (0, 0)
    bytes_h2d = [s.bytes_h2d for s in engines["on"].kv.layer_stats()]
    row_bytes = engines["on"].kv.counters.row_bytes
    assert bytes_h2d[1] >= (on[1][1] + on[1][3]) * row_bytes  # the bets' copies are counted as bytes moved
    prefetch = engines["on"].kv.backend.prefetch
    assert prefetch.speculative_launched == _decode_steps(runs["dense"]) * 2
    assert engines["off"].kv.backend.prefetch.speculative_launched == 0
    for engine in engines.values():
        assert engine.is_idle_and_empty()


def test_equality_check_catches_a_wrong_bet(tiny_dsa) -> None:
    """A bet that copies layer 0's host rows into layer 1's buffer (recording them as layer 1's) makes layer 1's
    own swap-in hit on wrong rows: tokens or logits differ from dense, so the comparison above can fail."""
    dense = run_script(make_engine(tiny_dsa, hisparse=False, **SMALL_BUFFER_ENGINE), _workload())
    engine = make_engine(tiny_dsa, hisparse=True, speculative_prefetch=True, **SMALL_BUFFER_ENGINE)
    co = engine.kv
    bufs, host = co.buffers, co.host
    wrong = ops.bind_swap_in(SwapInTables(
        buffer_slots=bufs.buffer_slots, buffer_tokens=bufs.buffer_tokens[1], lru_order=bufs.lru_order[1],
        host_rows=host.rows.table, host_pool=host.kv[0], device_pool=bufs.kv[1], num_recent=bufs.num_recent,
        counters=None,
    ))
    swaps = list(co.backend.prefetch.speculative_swaps)
    swaps[1] = wrong
    co.backend.prefetch.speculative_swaps = swaps
    result = run_script(engine, _workload(), replay=dense.schedule)
    with pytest.raises(AssertionError):
        assert_identical(dense, result)


@pytest.mark.parametrize("early", [False, True])
def test_the_bet_runs_between_its_layers_own_swap_ins(tiny_dsa, early: bool) -> None:
    engine = make_engine(tiny_dsa, hisparse=True, speculative_prefetch=True, early_swap_in=early,
                         **SMALL_BUFFER_ENGINE)
    events, pending_after = record_decode_order(engine)
    run_script(engine, _workload())
    if early:  # each layer's own swap-in and the bet on the next run from its prepare_attention, before attention
        per_step = [("swap", 0, None), ("bet", 1, None), ("attention", 0, None),
                    ("swap", 1, None), ("bet", 2, None), ("attention", 1, None),
                    ("swap", 2, None), ("attention", 2, None)]
    else:
        per_step = [("attention", 0, None), ("swap", 0, 0), ("bet", 1, 0),
                    ("attention", 1, None), ("swap", 1, 1), ("bet", 2, 1),
                    ("attention", 2, None), ("swap", 2, 2)]
    assert events and len(events) % len(per_step) == 0
    for i in range(0, len(events), len(per_step)):
        assert events[i:i + len(per_step)] == per_step, f"decode forward {i // len(per_step)}"
    assert pending_after and all(p == () for p in pending_after)


def test_glm5_bets_on_the_next_full_layer_after_its_followers(tiny_glm5) -> None:
    modes = [("dense", {"hisparse": False}),
             ("on", {"hisparse": True, "speculative_prefetch": True, "prefetch_shared_layers": True})]
    runs, engines = run_poisoned_modes(tiny_glm5, long_prompt_workload(5, (150, 90, 120)), modes, graphs=False,
                                       **SMALL_BUFFER_ENGINE)
    assert_identical(runs["dense"], runs["on"])
    stats = _stats(engines["on"])
    assert [layer for layer, s in enumerate(stats) if s[2] + s[3]] == [2]  # only full layer 2 receives bets
    engine = make_engine(tiny_glm5, hisparse=True, speculative_prefetch=True, prefetch_shared_layers=True,
                         **SMALL_BUFFER_ENGINE)
    events, _ = record_decode_order(engine)
    run_script(engine, long_prompt_workload(5, (150, 90, 120)))
    per_step = [("attention", 0, None), ("swap", 0, 0), ("swap", 1, 0), ("bet", 2, 0), ("attention", 1, None),
                ("attention", 2, None), ("swap", 2, 2), ("swap", 3, 2), ("attention", 3, None)]
    assert events and len(events) % len(per_step) == 0
    for i in range(0, len(events), len(per_step)):
        assert events[i:i + len(per_step)] == per_step, f"decode forward {i // len(per_step)}"


@pytest.mark.parametrize("prefetch_shared_layers", [False, True])
def test_the_bets_payoff_is_the_followers_misses_minus_the_full_layers(tiny_glm5, prefetch_shared_layers) -> None:
    """A shared follower swaps in its full layer's selection into an equal buffer: without bets both layers'
    counters are equal, so with bets the follower's misses are what the full layer would have missed."""
    workload = long_prompt_workload(5, (150, 90, 120))
    counters = {}
    for bets in (False, True):
        engine = make_engine(tiny_glm5, hisparse=True, speculative_prefetch=bets,
                             prefetch_shared_layers=prefetch_shared_layers, **SMALL_BUFFER_ENGINE)
        run_script(engine, workload)
        layers = engine.kv.layer_stats()
        counters[bets] = [(s.hits, s.misses) for s in layers]
        saved = [s.speculative_rows_saved for s in layers]
        if bets:
            assert saved == [None, None, layers[3].misses - layers[2].misses, None]
        else:
            assert saved == [None] * 4
            assert counters[False][0] == counters[False][1] and counters[False][2] == counters[False][3]
            assert counters[False][2][1] > 0  # the follower misses: the identity is not between empty counters
    assert counters[True][3] == counters[False][3]  # the follower's counters do not see the bets
    assert counters[True][:2] == counters[False][:2]  # nor does the first group, which nobody bets on


def test_dsa_layers_report_no_payoff(tiny_dsa) -> None:
    engine = make_engine(tiny_dsa, hisparse=True, speculative_prefetch=True, **SMALL_BUFFER_ENGINE)
    run_script(engine, _workload())
    assert all(s.speculative_rows_saved is None for s in engine.kv.layer_stats())
    assert engine.stats().hisparse_layers[1].speculative_misses > 0  # the bets did run


def test_a_forward_failing_before_the_layer_it_bet_on_leaves_nothing_pending(tiny_dsa) -> None:
    engine = make_engine(tiny_dsa, hisparse=True, speculative_prefetch=True, **SMALL_BUFFER_ENGINE)
    backend = engine.kv.backend
    decode_attention = backend._decode_attention
    seen: list[tuple[int, ...]] = []

    def failing(layer_id, q, topk, scale):
        if layer_id == 1:
            seen.append(backend.prefetch.pending_bets)
            raise RuntimeError("injected failure before the bet was used")
        return decode_attention(layer_id, q, topk, scale)

    gen = torch.Generator().manual_seed(2)
    engine.add_request("x", random_prompt(gen, 100), SamplingParams(max_tokens=4, temperature=0.0))
    backend._decode_attention = failing
    with pytest.raises(RuntimeError, match="injected failure"):
        for _ in range(4):
            engine.step()
    assert seen == [(1,)]  # the bet on layer 1 was launched at layer 0 and not yet waited for
    assert backend.prefetch.pending_bets == () and backend.prefetch.pending_layers == ()
    assert backend._batch is None


def test_the_config_switch_reaches_the_backend(tiny_dsa) -> None:
    engine = make_engine(tiny_dsa, hisparse=True, speculative_prefetch=True, side_stream_copy_blocks=24,
                         **SMALL_BUFFER_ENGINE)
    prefetch = engine.kv.backend.prefetch
    assert prefetch.speculative == {0: 1, 1: 2}
    caps = [None if s is None else s.max_copy_blocks for s in prefetch.speculative_swaps]
    assert caps == [None, 24, 24]  # the bets run on the side stream: capped like the followers
    assert make_engine(tiny_dsa, hisparse=True, **SMALL_BUFFER_ENGINE).kv.backend.prefetch.speculative == {}


def test_a_bet_without_its_swap_in_is_refused() -> None:
    with pytest.raises(ValueError, match="bound swap-in for every layer it bets on"):
        SwapInPrefetch({}, [], torch.device("cpu"), speculative={0: 1}, speculative_swaps=[None, None])
    with pytest.raises(ValueError, match="bound swap-in for every layer it bets on"):
        SwapInPrefetch({}, [], torch.device("cpu"), speculative={0: 2}, speculative_swaps=[None, None])
