"""Early swap-in (HiSparseConfig.early_swap_in, decode_server/hisparse/prefetch.py, issue 23 item 4), on CPU.

- tiny-dsa with a device buffer smaller than the prompts (misses in every layer): early on == early off == dense,
  greedy tokens and logits bit for bit, per-layer swap counters equal, one early launch per layer and decode step;
- the equality check catches a wrong early swap-in (each layer's swap-in run against another layer's tables);
- the order inside a decode forward: a layer's swap-in runs from its prepare_attention (right after its
  selection), before its write_kv and its attention; with GLM-5's shared-layer prefetch the followers' swap-ins
  follow their full layer's own; without it a shared layer launches its own early; nothing is pending after a
  forward, an aborted one included;
- a wrapper that replaces index_topk's result (as bench_decode's synthetic top-k does) is followed: the swap-in
  runs on the tensor the attention gets;
- an attention handed another top-k tensor than the one it prepared with refuses it.
The CUDA side (side stream, events, graphs) is tests/hisparse/test_early_swap_in_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from harness import (
    SMALL_BUFFER_ENGINE,
    Arrival,
    assert_failed_attention_leaves_nothing_pending,
    assert_identical,
    long_prompt_workload,
    make_engine,
    random_prompt,
    run_poisoned_modes,
    run_script,
    swap_counters,
)

from decode_server.engine.forward_context import get_forward_context
from decode_server.engine.sampling_params import SamplingParams
from decode_server.model import Tokenizer, load_model, resolve_model_path


def _workload() -> list[Arrival]:
    return long_prompt_workload(9, (140, 95, 125))


def _engine(tiny, hisparse: bool, early: bool = True, prefetch: bool = False):
    """`early` on unless told: the switch under test (the server's default is off)."""
    return make_engine(tiny, hisparse=hisparse, **SMALL_BUFFER_ENGINE, early_swap_in=early,
                       prefetch_shared_layers=prefetch)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_default_is_off_and_the_key_switches_it() -> None:
    from decode_server.config import HiSparseConfig

    assert HiSparseConfig().early_swap_in is False  # measured no faster (docs/benchmarks.md)
    assert HiSparseConfig.from_json('{"early_swap_in": true}').early_swap_in is True


def test_early_swap_in_is_bit_identical_to_dense_and_to_late(tiny_cpu) -> None:
    modes = [("dense", {"hisparse": False}), ("late", {"hisparse": True, "early_swap_in": False}),
             ("early", {"hisparse": True, "early_swap_in": True})]
    runs, engines = run_poisoned_modes(tiny_cpu, _workload(), modes, graphs=False, **SMALL_BUFFER_ENGINE)
    dense, late, early = runs["dense"], runs["late"], runs["early"]
    dense_engine, late_engine, early_engine = engines["dense"], engines["late"], engines["early"]
    assert_identical(dense, late)
    assert_identical(dense, early)
    assert len({tuple(t) for t in dense.tokens.values()}) == 4  # prompt-dependent outputs
    counters = swap_counters(early_engine)
    assert counters == swap_counters(late_engine), "the early swap-in changed the swap-in counters"
    assert all(misses > 0 for _, misses in counters), f"a layer never missed: nothing was copied early {counters}"
    decode_steps = sum(1 for s in dense.schedule if s is not None and s[3])
    layers = len(counters)
    assert early_engine.kv.backend.prefetch.early_launched == decode_steps * layers
    assert late_engine.kv.backend.prefetch.early_launched == 0
    for engine in (early_engine, late_engine, dense_engine):
        assert engine.is_idle_and_empty()


def test_equality_check_catches_a_wrong_early_swap_in(tiny_cpu) -> None:
    """The comparison above must be able to fail: early swap-ins run against the next layer's tables hand out
    slots whose rows of this layer were never copied there, so tokens or logits differ from dense."""
    dense = run_script(_engine(tiny_cpu, hisparse=False), _workload())
    engine = _engine(tiny_cpu, hisparse=True)
    backend = engine.kv.backend
    swaps = list(backend.swaps)
    backend.prefetch.swaps = [swaps[(i + 1) % len(swaps)] for i in range(len(swaps))]
    wrong = run_script(engine, _workload())  # its own schedule: wrong tokens may change it
    with pytest.raises(AssertionError):
        assert_identical(dense, wrong)


def _record_order(engine) -> tuple[list[tuple[str, int]], list[tuple[int, ...]]]:
    """Wrap the backend's swap-ins, write_kv and decode attention; return the event list (filled as the engine
    runs) and the pending layers seen after each end_forward."""
    backend = engine.kv.backend
    events: list[tuple[str, int]] = []

    def wrap_swap(layer: int, swap):
        def recording(top_k, seq_lens, req_rows):
            events.append(("swap", layer))
            return swap(top_k, seq_lens, req_rows)
        return recording

    backend.swaps[:] = [wrap_swap(layer, swap) for layer, swap in enumerate(backend.swaps)]
    write_kv, decode_attention, end_forward = backend.write_kv, backend._decode_attention, backend.end_forward

    def recording_write(layer_id, rows):
        if backend._current().is_decode:
            events.append(("write_kv", layer_id))
        write_kv(layer_id, rows)

    def recording_attention(layer_id, q, topk, scale):
        events.append(("attention", layer_id))
        return decode_attention(layer_id, q, topk, scale)

    pending_after: list[tuple[int, ...]] = []

    def checking_end(batch):
        end_forward(batch)
        pending_after.append(backend.prefetch.pending_layers)

    backend.write_kv, backend._decode_attention, backend.end_forward = recording_write, recording_attention, checking_end
    return events, pending_after


def _assert_per_step(events: list[tuple[str, int]], per_step: list[tuple[str, int]]) -> None:
    assert events and len(events) % len(per_step) == 0, events[:20]
    for i in range(0, len(events), len(per_step)):
        assert events[i:i + len(per_step)] == per_step, f"decode forward {i // len(per_step)}: {events[i:i + 12]}"


def test_each_layer_swaps_in_before_its_projections(tiny_cpu) -> None:
    engine = _engine(tiny_cpu, hisparse=True)
    events, pending_after = _record_order(engine)
    run_script(engine, _workload())
    layers = engine.model_config.num_hidden_layers
    _assert_per_step(events, [e for layer in range(layers)
                              for e in (("swap", layer), ("write_kv", layer), ("attention", layer))])
    assert pending_after and all(p == () for p in pending_after)


def test_late_swap_in_keeps_the_old_order(tiny_cpu) -> None:
    engine = _engine(tiny_cpu, hisparse=True, early=False)
    events, _ = _record_order(engine)
    run_script(engine, _workload())
    layers = engine.model_config.num_hidden_layers
    _assert_per_step(events, [e for layer in range(layers)
                              for e in (("write_kv", layer), ("attention", layer), ("swap", layer))])


@pytest.fixture(scope="module")
def tiny_glm5():
    model, config = load_model("tiny-glm5", "cpu", torch.float32)
    return model, config, Tokenizer.from_dir(resolve_model_path("tiny-glm5"))


def test_with_shared_layer_prefetch(tiny_glm5) -> None:
    """tiny-glm5 (full, shared, full, shared): the full layer's prepare_attention launches its own swap-in, then
    its follower's; still equal to dense."""
    dense = run_script(_engine(tiny_glm5, hisparse=False), _workload())
    engine = _engine(tiny_glm5, hisparse=True, prefetch=True)
    engine.kv.host.kv.fill_(0xFF)
    engine.kv.buffers.kv.fill_(0xFF)
    events, pending_after = _record_order(engine)
    result = run_script(engine, _workload(), replay=dense.schedule)
    assert_identical(dense, result)
    _assert_per_step(events, [("swap", 0), ("swap", 1), ("write_kv", 0), ("attention", 0), ("write_kv", 1),
                              ("attention", 1), ("swap", 2), ("swap", 3), ("write_kv", 2), ("attention", 2),
                              ("write_kv", 3), ("attention", 3)])
    assert all(p == () for p in pending_after)
    prefetch = engine.kv.backend.prefetch
    assert prefetch.early_launched == prefetch.launched > 0  # each full layer: its own and one follower


def test_shared_layers_launch_their_own_without_the_prefetch(tiny_glm5) -> None:
    engine = _engine(tiny_glm5, hisparse=True, prefetch=False)
    events, pending_after = _record_order(engine)
    run_script(engine, _workload())
    _assert_per_step(events, [e for layer in range(4)
                              for e in (("swap", layer), ("write_kv", layer), ("attention", layer))])
    assert all(p == () for p in pending_after)
    assert engine.kv.backend.prefetch.launched == 0


def test_a_replaced_selection_is_the_one_swapped_in(tiny_cpu) -> None:
    """bench_decode's SyntheticTopK wraps index_topk and returns another tensor: the early swap-in must run on
    that one (the first version launched from inside index_topk and refused the replaced tensor). Here the
    wrapper returns the selection in reverse order (a new tensor; misses are assigned in top-k order), and HiSparse
    must equal dense wrapped the same way."""

    def wrap(engine):
        backend = engine.kv.backend
        original = backend.index_topk

        def replaced(layer_id, q, weights, top_k):
            real = original(layer_id, q, weights, top_k)
            if not get_forward_context().batch.is_decode:
                return real
            return real.flip(1).contiguous()
        backend.index_topk = replaced
        return engine

    dense = run_script(wrap(_engine(tiny_cpu, hisparse=False)), _workload())
    engine = wrap(_engine(tiny_cpu, hisparse=True))
    engine.kv.host.kv.fill_(0xFF)
    engine.kv.buffers.kv.fill_(0xFF)
    assert_identical(dense, run_script(engine, _workload(), replay=dense.schedule))
    assert engine.kv.backend.prefetch.early_launched > 0


def test_an_aborted_forward_leaves_nothing_pending(tiny_cpu) -> None:
    assert_failed_attention_leaves_nothing_pending(_engine(tiny_cpu, hisparse=True), 0,
                                                   "injected failure in an attention")


def test_attention_refuses_a_different_top_k(tiny_cpu) -> None:
    """The early slots belong to the selection the layer prepared with: an attention handed another tensor fails
    loudly instead of attending over rows of the wrong tokens."""
    engine = _engine(tiny_cpu, hisparse=True)
    backend = engine.kv.backend
    decode_attention = backend._decode_attention

    def other_topk(layer_id, q, topk, scale):
        return decode_attention(layer_id, q, topk.clone(), scale)

    gen = torch.Generator().manual_seed(3)
    engine.add_request("x", random_prompt(gen, 100), _greedy(4))
    backend._decode_attention = other_topk
    with pytest.raises(RuntimeError, match="other than the one its swap-in was launched with"):
        for _ in range(4):
            engine.step()
    assert backend.prefetch.pending_layers == ()
