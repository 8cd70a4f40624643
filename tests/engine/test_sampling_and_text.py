"""Sampler filters and the incremental detokenizer / stop-string checker, without the model."""

from __future__ import annotations

import torch

from decode_server.engine.detokenizer import IncrementalDetokenizer, StopStringChecker
from decode_server.engine.sampler import Sampler, filter_logits, make_generator
from decode_server.engine.sampling_params import SamplingParams


def test_filter_top_k_and_top_p():
    logits = torch.tensor([3.0, 1.0, 2.0, 0.0])
    assert torch.isinf(filter_logits(logits, 2, 1.0)).tolist() == [False, True, False, True]
    probs = torch.softmax(logits, 0)  # ≈ [0.64, 0.09, 0.24, 0.03]
    kept = ~torch.isinf(filter_logits(logits, -1, 0.8))
    assert kept.tolist() == [True, False, True, False]
    assert float(probs[kept].sum()) >= 0.8
    assert (~torch.isinf(filter_logits(logits, 0, 0.5))).tolist() == [True, False, False, False]


def test_sampler_seeded_and_greedy():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(top_k=1)]
    a, _ = sampler.sample(logits, params, [None, make_generator(7, torch.device("cpu")), None])
    b, _ = sampler.sample(logits, params, [None, make_generator(7, torch.device("cpu")), None])
    assert a == b
    assert a[0] == int(logits[0].argmax()) and a[2] == int(logits[2].argmax())
    draws = {sampler.sample(logits[1:2], params[1:2], [make_generator(s, torch.device("cpu"))])[0][0]
             for s in range(20)}
    assert len(draws) > 1


class CharTokenizer:
    """Token i is byte i; multi-byte UTF-8 characters span several tokens (like byte-level BPE)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_incremental_detokenizer_matches_full_decode():
    text = "héllo wörld ✓ done"
    ids = list(text.encode("utf-8"))
    detok = IncrementalDetokenizer(CharTokenizer(), prompt_ids=list(b"prompt "))
    pieces = [detok.add([t]) for t in ids]
    assert "".join(pieces) + detok.flush() == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_across_deltas_is_never_shown():
    checker = StopStringChecker(["STOP"])
    shown = [checker.add(x) for x in ["abc S", "T", "O", "P tail"]]
    assert "".join(shown) == "abc " and checker.matched == "STOP"
    checker = StopStringChecker(["STOP"])
    shown = [checker.add(x) for x in ["abc S", "Tx"]] + [checker.finish()]
    assert "".join(shown) == "abc STx" and checker.matched is None


def test_tiny_temperature_and_top_p_never_produce_nan():
    logits = torch.tensor([[50.0, 49.0, -20.0, 3.0]])
    sampler = Sampler()
    for t in (1e-8, 1e-5, 1e-3):
        for top_p in (1e-9, 1e-300):  # 1e-300 underflows to 0 in float32
            params = SamplingParams(temperature=t, top_p=top_p)
            tok, _ = sampler.sample(logits, [params], [make_generator(0, torch.device("cpu"))])
            assert tok == [0]


def test_stop_strings_wait_until_armed():
    """min_tokens: text added while not armed cannot stop alone; a stop string that ends in later text does."""
    checker = StopStringChecker(["ab"])
    shown = [checker.add("xab", armed=False), checker.add("y", armed=False), checker.add("a"), checker.add("bz")]
    assert checker.matched == "ab" and "".join(shown) == "xaby"
    checker = StopStringChecker(["ab"])
    shown = [checker.add("xa", armed=False), checker.add("b")]  # the match straddles the arming: it stops
    assert checker.matched == "ab" and "".join(shown) == "x"
    checker = StopStringChecker(["ab"])
    shown = [checker.add("ab", armed=False), checker.add("c"), checker.finish()]
    assert checker.matched is None and "".join(shown) == "abc"


def test_sampling_params_edits_are_checked():
    import pytest
    from pydantic import ValidationError

    for bad in ({"min_tokens": 17}, {"logit_bias": {3: 100.5}}, {"logit_bias": {-1: 1.0}},
                {"logit_bias": {3: float("nan")}}, {"repetition_penalty": 0.0}, {"frequency_penalty": 2.5},
                {"presence_penalty": -3.0}):
        with pytest.raises(ValidationError):
            SamplingParams(max_tokens=16, **bad)
    p = SamplingParams(max_tokens=16, min_tokens=16, logit_bias={3: -100.0}, repetition_penalty=1.0)
    assert not p.uses_token_counts
    assert SamplingParams(presence_penalty=0.1).uses_token_counts
