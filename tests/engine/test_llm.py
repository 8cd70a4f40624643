"""Offline API: determinism, sampling knobs, stop strings, stop token ids, max_tokens, EOS, batches."""

from __future__ import annotations

import pytest

from decode_server.engine.llm import LLM
from decode_server.engine.sampling_params import SamplingParams


@pytest.fixture
def llm(make_engine):
    return LLM(engine=make_engine())


PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Hello"]


def test_same_seed_same_tokens_and_batch_independence(llm):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    first = llm.generate(PROMPTS, params)
    again = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    alone = llm.generate(PROMPTS[1], params)
    assert alone[0].token_ids == first[1].token_ids
    other = llm.generate(PROMPTS[1], params.model_copy(update={"seed": 99}))
    assert other[0].token_ids != first[1].token_ids


def test_greedy_equivalents(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
    top1 = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=1.0, top_k=1, seed=5))
    tiny_p = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.7, top_p=1e-6, seed=5))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in top1] == [o.token_ids for o in tiny_p]


def test_max_tokens_and_text_matches_tokens(llm):
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=7, temperature=0.0))
    for o, prompt in zip(out, PROMPTS, strict=True):
        assert o.finish_reason == "length" and len(o.token_ids) == 7
        assert o.prompt == prompt and o.prompt_token_ids == llm.tokenizer.encode(prompt)
        assert o.text == llm.tokenizer.decode(o.token_ids)


def test_token_id_prompts_equal_text_prompts(llm):
    params = SamplingParams(max_tokens=5, temperature=0.0)
    by_text = llm.generate(PROMPTS[:2], params)
    by_ids = llm.generate([llm.tokenizer.encode(p) for p in PROMPTS[:2]], params)
    assert [o.token_ids for o in by_text] == [o.token_ids for o in by_ids]
    single = llm.generate(llm.tokenizer.encode(PROMPTS[0]), params)
    assert single[0].token_ids == by_text[0].token_ids


def test_stop_token_ids(llm):
    base = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0))[0].token_ids
    stop = base[5]
    first = base.index(stop)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop]))[0]
    assert out.token_ids == base[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_strings_cut_text(llm):
    base = llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0.0))[0]
    text = base.text
    stop = text[6:9]
    assert stop and stop in text
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, temperature=0.0, stop=[stop, "\x00never"]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert len(out.token_ids) < 16 and base.token_ids[: len(out.token_ids)] == out.token_ids


def test_eos_stops_unless_ignored(llm):
    base = llm.generate(PROMPTS[2], SamplingParams(max_tokens=10, temperature=0.0))[0].token_ids
    llm.engine.eos_token_ids = frozenset({base[3]})
    out = llm.generate(PROMPTS[2], SamplingParams(max_tokens=10, temperature=0.0))[0]
    assert out.token_ids == base[: base.index(base[3]) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    ignored = llm.generate(PROMPTS[2], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert ignored.token_ids == base and ignored.finish_reason == "length"


def test_logprobs(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3))[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == tok and lp.logprob <= 0.0
        assert len(lp.top_logprobs) == 3 and lp.top_logprobs[0][0] == tok  # greedy picks the best


def test_hisparse_llm_matches_dense(make_engine):
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3)
    long_prompt = "once upon a time " * 8  # longer than the 64-token device buffer
    dense = LLM(engine=make_engine()).generate([long_prompt, PROMPTS[0]], params)
    sparse = LLM(engine=make_engine(enable_hisparse=True)).generate([long_prompt, PROMPTS[0]], params)
    assert [o.token_ids for o in dense] == [o.token_ids for o in sparse]
