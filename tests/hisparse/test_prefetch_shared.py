"""Early swap-in of GLM-5 shared layers (decode_server/hisparse/prefetch.py, issue 23 item 3), on CPU.

- the followers map for several `indexer_types` patterns;
- tiny-glm5 (full, shared, full, shared) with a device buffer smaller than the prompts, so the shared layers miss:
  prefetch on == prefetch off == dense, greedy tokens and logits bit for bit, per-layer swap counters equal;
- the equality check catches a wrong prefetch (the followers' swap-ins run against the full layer's tables);
- the followers' swap-ins are called during the full layer's attention, before the follower's; nothing is pending
  after a forward, an aborted one included.
The CUDA side (side stream, events, graphs) is tests/hisparse/test_prefetch_shared_gpu.py.
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
    record_decode_order,
    run_poisoned_modes,
    run_script,
    swap_counters,
)

from decode_server.config import HiSparseConfig
from decode_server.engine.kv_rows import CacheGeometry
from decode_server.hisparse.prefetch import shared_followers
from decode_server.model import Tokenizer, load_model, resolve_model_path

SHARED_LAYERS = (1, 3)  # tiny-glm5: full, shared, full, shared


@pytest.fixture(scope="module")
def tiny_glm5():
    model, config = load_model("tiny-glm5", "cpu", torch.float32)
    return model, config, Tokenizer.from_dir(resolve_model_path("tiny-glm5"))


def _geometry(types: str) -> CacheGeometry:
    return CacheGeometry(len(types), index_layers=tuple(i for i, t in enumerate(types) if t == "F"))


@pytest.mark.parametrize(("types", "expected"), [
    ("FSFS", {0: (1,), 2: (3,)}),
    ("FSSS", {0: (1, 2, 3)}),
    ("FFFF", {}),
    ("FFSSF", {1: (2, 3)}),
    ("FSSFFSF", {0: (1, 2), 4: (5,)}),
    ("SFS", {1: (2,)}),  # a leading shared layer has no full layer to follow (the model refuses it)
])
def test_shared_followers(types: str, expected: dict[int, tuple[int, ...]]) -> None:
    assert shared_followers(_geometry(types)) == expected


def test_every_layer_full_by_default() -> None:
    assert shared_followers(CacheGeometry(3)) == {}  # DeepSeek-V3.2: nothing to prefetch


def _workload() -> list[Arrival]:
    return long_prompt_workload(5, (150, 90, 120))


@pytest.mark.parametrize(("prefetch", "early", "capped"), [
    (True, False, {1, 3}),  # the followers run on the side stream; the full layers' own swap-ins do not
    (True, True, {0, 1, 2, 3}),  # every layer's swap-in is launched early, on the side stream
    (False, True, {0, 1, 2, 3}),
    (False, False, set()),
])
def test_side_stream_swap_ins_take_the_copy_cap(tiny_glm5, prefetch: bool, early: bool, capped: set[int]) -> None:
    """`side_stream_copy_blocks` caps the copy grid of exactly the swap-ins that run beside other kernels."""
    for cap in (24, "auto"):
        engine = make_engine(tiny_glm5, hisparse=True, **SMALL_BUFFER_ENGINE, prefetch_shared_layers=prefetch,
                             early_swap_in=early, side_stream_copy_blocks=cap)
        caps = [swap.max_copy_blocks for swap in engine.kv.backend.swaps]
        assert caps == [cap if layer in capped else 0 for layer in range(len(caps))]


def test_side_stream_copy_blocks_config() -> None:
    """The engine's default cap is "auto"; a block count or 0 (no cap) is taken, a negative count or another word
    is refused with the key's name."""
    assert HiSparseConfig().side_stream_copy_blocks == "auto"
    assert HiSparseConfig.from_json('{"side_stream_copy_blocks": 16}').side_stream_copy_blocks == 16
    assert HiSparseConfig.from_json('{"side_stream_copy_blocks": 0}').side_stream_copy_blocks == 0
    for bad in ('-1', '"many"', '1.5'):
        with pytest.raises(ValueError, match="side_stream_copy_blocks"):
            HiSparseConfig.from_json('{"side_stream_copy_blocks": ' + bad + '}')


def _engine(tiny, hisparse: bool, prefetch: bool = False, early: bool = False):
    """`early` off by default: these tests follow the followers' launch from the full layer's attention (the
    early swap-in, which launches them from its index_topk, is tests/hisparse/test_early_swap_in.py)."""
    return make_engine(tiny, hisparse=hisparse, **SMALL_BUFFER_ENGINE, prefetch_shared_layers=prefetch,
                       early_swap_in=early)


def test_prefetch_is_bit_identical_to_dense_and_to_no_prefetch(tiny_glm5) -> None:
    modes = [("dense", {"hisparse": False}), ("off", {"hisparse": True, "prefetch_shared_layers": False}),
             ("on", {"hisparse": True, "prefetch_shared_layers": True})]
    runs, engines = run_poisoned_modes(tiny_glm5, _workload(), modes, graphs=False,
                                       **SMALL_BUFFER_ENGINE)
    dense, off, on = runs["dense"], runs["off"], runs["on"]
    dense_engine, off_engine, on_engine = engines["dense"], engines["off"], engines["on"]
    assert_identical(dense, off)
    assert_identical(dense, on)
    assert len({tuple(t) for t in dense.tokens.values()}) == 4  # prompt-dependent outputs
    counters = swap_counters(on_engine)
    assert counters == swap_counters(off_engine), "the prefetch changed the swap-in counters"
    for layer in SHARED_LAYERS:
        assert counters[layer][1] > 0, f"shared layer {layer} never missed: the prefetch copied nothing"
    backend = on_engine.kv.backend
    decode_steps = sum(1 for s in dense.schedule if s is not None and s[3])
    assert backend.prefetch.launched == decode_steps * len(SHARED_LAYERS)  # every decode step, every follower
    assert off_engine.kv.backend.prefetch.launched == 0
    for engine in (on_engine, off_engine, dense_engine):
        assert engine.is_idle_and_empty()


def test_equality_check_catches_a_wrong_prefetch(tiny_glm5) -> None:
    """The comparison above must be able to fail: a prefetch that runs each follower's swap-in against its full
    layer's tables (wrong layer) hands out slots whose rows of the follower's layer were never copied there, and
    the tokens or logits differ from dense."""
    dense = run_script(_engine(tiny_glm5, hisparse=False), _workload())
    engine = _engine(tiny_glm5, hisparse=True, prefetch=True)
    backend = engine.kv.backend
    # Follower j swaps in with the tables of the full layer before it (0 for 1, 2 for 3).
    backend.prefetch.swaps = [backend.swaps[0], backend.swaps[0], backend.swaps[2], backend.swaps[2]]
    wrong = run_script(engine, _workload(), replay=dense.schedule)
    with pytest.raises(AssertionError):
        assert_identical(dense, wrong)


def test_followers_swap_in_during_the_full_layers_attention(tiny_glm5) -> None:
    engine = _engine(tiny_glm5, hisparse=True, prefetch=True)
    events, pending_after = record_decode_order(engine)  # (what, layer, attention layer running when it happened)
    run_script(engine, _workload())
    per_step = [("attention", 0, None), ("swap", 0, 0), ("swap", 1, 0), ("attention", 1, None),
                ("attention", 2, None), ("swap", 2, 2), ("swap", 3, 2), ("attention", 3, None)]
    assert events and len(events) % len(per_step) == 0
    for i in range(0, len(events), len(per_step)):
        assert events[i:i + len(per_step)] == per_step, f"decode forward {i // len(per_step)}: {events[i:i + 8]}"
    assert pending_after and all(p == () for p in pending_after)


def test_an_aborted_forward_leaves_nothing_pending(tiny_glm5) -> None:
    """A forward that fails between a full layer and its follower: end_forward still joins the prefetched
    swap-in, so nothing leaks into the next forward (which begin_forward would refuse)."""
    assert_failed_attention_leaves_nothing_pending(_engine(tiny_glm5, hisparse=True, prefetch=True), 1,
                                                   "injected failure in a shared layer")


def test_a_leftover_prefetch_is_refused_and_dropped(tiny_glm5, monkeypatch) -> None:
    """Were end_forward ever to miss a join (it does not: this simulates the bug), the next forward refuses to
    start rather than hand a stale prefetch to a follower, and drops it, so the forward after that can run."""
    engine = _engine(tiny_glm5, hisparse=True, prefetch=True)
    backend = engine.kv.backend
    decode_attention = backend._decode_attention

    def failing(layer_id, q, topk, scale):
        if layer_id == 1:
            raise RuntimeError("injected failure in a shared layer")
        return decode_attention(layer_id, q, topk, scale)

    gen = torch.Generator().manual_seed(4)
    engine.add_request("x", random_prompt(gen, 100), _greedy(4))
    backend._decode_attention = failing
    with monkeypatch.context() as patch:
        patch.setattr(backend.prefetch, "join", lambda: None)
        with pytest.raises(RuntimeError, match="injected failure"):
            for _ in range(4):
                engine.step()
    assert backend.prefetch.pending_layers == (1,)
    with pytest.raises(RuntimeError, match="outlived their forward"):
        engine.step()
    assert backend.prefetch.pending_layers == ()


def test_follower_refuses_a_different_top_k(tiny_glm5) -> None:
    """The prefetched slots belong to the full layer's selection: a follower handed another top-k tensor fails
    loudly instead of attending over rows of the wrong tokens."""
    engine = _engine(tiny_glm5, hisparse=True, prefetch=True)
    backend = engine.kv.backend
    decode_attention = backend._decode_attention

    def other_topk(layer_id, q, topk, scale):
        return decode_attention(layer_id, q, topk.clone() if layer_id == 1 else topk, scale)

    gen = torch.Generator().manual_seed(3)
    engine.add_request("x", random_prompt(gen, 100), _greedy(4))
    backend._decode_attention = other_topk
    with pytest.raises(RuntimeError, match="other than the one its swap-in was launched with"):
        for _ in range(4):
            engine.step()
    assert backend.prefetch.pending_layers == ()


def _greedy(max_tokens: int):
    from decode_server.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
