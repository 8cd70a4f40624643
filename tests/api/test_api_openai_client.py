"""The official `openai` client against a real server: completions, chat, streaming with usage, stop strings,
n, logprobs, and 32 concurrent greedy requests equal to the offline `LLM`."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from api_server_harness import API_KEY, ServerProcess

from decode_server.engine.llm import LLM
from decode_server.engine.sampling_params import SamplingParams

MODEL = "tiny-dsa"
PROMPTS = [f"Request {i}: the quick brown fox number {i * 7} jumps over" for i in range(32)]


@pytest.fixture(scope="module")
def client(dense_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=dense_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(offline_llm: LLM) -> LLM:
    return offline_llm


def test_models(client: openai.OpenAI, dense_server: ServerProcess) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("gpt-4")
    assert "not served" in str(exc.value)
    version = httpx.get(dense_server.url + "/version", headers=dense_server.headers, timeout=10).json()["version"]
    assert version and version[0].isdigit()


def test_completion_usage_and_length(client: openai.OpenAI, offline: LLM) -> None:
    out = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=6, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 6
    expected = offline.generate(["Hello world"], SamplingParams(max_tokens=6, temperature=0))[0]
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + 6
    assert choice.text == expected.text


def test_chat(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
        max_completion_tokens=5, temperature=0,
    )  # fmt: skip
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5 and out.usage.prompt_tokens > 0


def test_streaming_completion_matches_non_streaming(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_streaming_chat_with_usage(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me a story"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "length"
    ]
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_continuous_usage_stats_count_the_tokens_so_far(client: openai.OpenAI, route: str) -> None:
    """vLLM's `continuous_usage_stats`: every chunk carries the usage so far, growing one token a chunk."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    if route == "chat":
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go on"}],
                                                max_tokens=6, temperature=0, stream=True, stream_options=options,
                                                extra_body={"ignore_eos": True})  # fmt: skip
    else:
        stream = client.completions.create(model=MODEL, prompt="Go on", max_tokens=6, temperature=0, stream=True,
                                           stream_options=options, extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    prompt = chunks[-1].usage.prompt_tokens
    assert prompt > 0 and all(c.usage.prompt_tokens == prompt for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 6 and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage.total_tokens == prompt + c.usage.completion_tokens for c in chunks)


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=4, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=["Once upon", "A time"], max_tokens=4, temperature=0,
                                       echo=True)  # fmt: skip
    first, second = sorted(echoed.choices, key=lambda c: c.index)
    assert first.text == "Once upon" + plain.choices[0].text and second.text.startswith("A time")
    by_ids = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0)
    ids_echoed = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0, echo=True)
    from decode_server.model import Tokenizer, resolve_model_path

    ids_text = Tokenizer.from_dir(resolve_model_path(MODEL)).decode([5, 6, 7], skip_special_tokens=False)
    assert ids_echoed.choices[0].text == ids_text + by_ids.choices[0].text
    stream = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=4, temperature=0, echo=True,
                                       stream=True)  # fmt: skip
    chunks = [c.choices[0].text for c in stream if c.choices]
    assert chunks[0].startswith("Once upon") and "".join(chunks) == first.text  # with the first token


def test_echo_with_logprobs_scores_the_prompt(client: openai.OpenAI, offline: LLM) -> None:
    """echo + logprobs (lm-eval's loglikelihood requests): the prompt's tokens with their logprobs (the first has
    none), then the output's; equal to the engine's prompt logprobs; a stream gives the same, the prompt first."""
    prompt = [5, 6, 7, 300, 41, 9]
    (expected,) = offline.generate([prompt], SamplingParams(max_tokens=3, temperature=0, logprobs=2,
                                                            prompt_logprobs=2))  # fmt: skip
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [x.logprob for x in expected.prompt_logprobs[1:]] + [
        x.logprob for x in expected.logprobs]
    assert [len(t) for t in lp.top_logprobs[1:]] == [2] * (len(prompt) - 1 + 3)
    assert lp.text_offset == sorted(lp.text_offset)
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                              logprobs=2, stream=True))  # fmt: skip
    parts = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert len(parts[0].tokens) == len(prompt) + 1  # the prompt comes with the first token
    assert [t for p in parts for t in p.token_logprobs] == lp.token_logprobs
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text


def test_stream_without_usage_ends_with_done(dense_server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "stream": True}
    with httpx.stream(
        "POST", dense_server.url + "/v1/completions", json=body, headers=dense_server.headers
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    assert '"usage"' not in lines[-2] or '"usage":null' in lines[-2]


def test_stop_string_finishes_with_stop(client: openai.OpenAI) -> None:
    full = (
        client.completions.create(model=MODEL, prompt="The sea", max_tokens=16, temperature=0).choices[0].text
    )
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"greedy text too short to pick a stop string: {full!r}"
    out = client.completions.create(model=MODEL, prompt="The sea", max_tokens=16, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[: full.index(stop)]


def test_n_choices(client: openai.OpenAI) -> None:
    greedy = client.completions.create(model=MODEL, prompt="Numbers:", max_tokens=5, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.text for c in greedy.choices}) == 1
    assert greedy.usage.completion_tokens == 15
    sampled = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=12, temperature=1.0, n=2, seed=7
    )
    again = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=12, temperature=1.0, n=2, seed=7
    )
    assert [c.message.content for c in sampled.choices] == [c.message.content for c in again.choices]


def test_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == 4 and len(lp.token_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(t is not None and 1 <= len(t) <= 3 for t in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(
        abs(max(t.values()) - v) < 1e-4 for t, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)


def test_32_concurrent_greedy_equal_offline(dense_server: ServerProcess, offline: LLM) -> None:
    params = SamplingParams(max_tokens=8, temperature=0)
    expected = [o.text for o in offline.generate(PROMPTS, params)]

    async def run_all() -> list[str]:
        aclient = openai.AsyncOpenAI(
            base_url=dense_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300
        )
        async with aclient:
            outs = await asyncio.gather(
                *(
                    aclient.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
                    for p in PROMPTS
                )
            )
        assert all(o.choices[0].finish_reason == "length" for o in outs)
        return [o.choices[0].text for o in outs]

    got = asyncio.run(run_all())
    mismatches = [(i, g, e) for i, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e]
    assert not mismatches, mismatches


def test_streaming_n_choices_and_prompt_list(client: openai.OpenAI) -> None:
    prompts = ["First prompt", "Second one"]
    full = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in full.choices] == [0, 1, 2, 3]
    stream = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=4, temperature=0, n=2, stream=True
    )
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in full.choices}
    assert finishes == {0: "length", 1: "length", 2: "length", 3: "length"}
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: the n copies agree


def test_penalties_logit_bias_and_min_tokens(client: openai.OpenAI, offline: LLM) -> None:
    """OpenAI's `frequency_penalty`, `presence_penalty` and `logit_bias`, and vLLM's / SGLang's `repetition_penalty`
    and `min_tokens` (the openai client's `extra_body`): each greedy answer equals the offline engine's with the same
    parameters (which the engine tests check token by token against the definitions), and changes the answer."""
    prompt = "The quick brown fox"
    plain = offline.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    favoured = sorted(set(plain.token_ids))[:3]
    bias = {str(t): 8.0 for t in favoured}
    cases = [
        ({"logit_bias": bias}, {"logit_bias": {t: 8.0 for t in favoured}}, {}),
        ({"logit_bias": bias, "frequency_penalty": 1.5, "presence_penalty": 0.5},
         {"logit_bias": {t: 8.0 for t in favoured}, "frequency_penalty": 1.5, "presence_penalty": 0.5}, {}),
        ({"logit_bias": bias}, {"logit_bias": {t: 8.0 for t in favoured}, "repetition_penalty": 1.8},
         {"repetition_penalty": 1.8}),
    ]
    answers = set()
    for openai_args, engine_args, extra in cases:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra,
                                        **openai_args)
        want = offline.generate([prompt], SamplingParams(max_tokens=12, temperature=0, **engine_args))[0]
        assert out.choices[0].text == want.text, (openai_args, extra)
        answers.add(want.text)
    assert plain.text not in answers and len(answers) == len(cases), "each edit should change the greedy answer"
    eos = sorted(offline.engine.eos_token_ids)[0]
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10, temperature=0,
        logit_bias={str(eos): 100}, extra_body={"min_tokens": 4},
    )  # fmt: skip
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 5
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10, temperature=0, stream=True,
        logit_bias={str(eos): 100}, extra_body={"min_tokens": 2}, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 3
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
