"""`--enable-prefix-caching` on real servers (dense and HiSparse), with the openai client.

- a prompt sharing at least a page (64 tokens, plus its last token) with an earlier one reuses the shared whole
  pages: `usage.prompt_tokens_details.cached_tokens` says how many (completions, chat, streamed usage), and the
  greedy text is the offline engine's, computed without any cache;
- a request admitted while another with the same prefix still decodes reuses that prefix already (cached when its
  prefill ended), and /flush_cache keeps pages a running request maps;
- /metrics reports the hit rate and counters, /flush_cache drops every unmapped page (the pools are empty again)
  and the next prompt computes everything;
- without the flag (the shared `dense_server`): no `prompt_tokens_details` in usage, /flush_cache answers
  `prefix_caching: false`, no cache metrics;
- `--enable-prefix-caching` with SGLang's `--disable-radix-cache` is a usage error (a PD decode server refusing the
  flag: tests/disagg/test_pd_config.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from api_server_harness import API_KEY, ServerProcess, flush_cache, metric_values, wait_until_idle

from decode_server.engine.llm import LLM
from decode_server.engine.sampling_params import SamplingParams

MODEL = "tiny-dsa"
PAGE = 64  # the default --page-size: only whole pages are cached
HISPARSE_ARGS = ("--enable-hisparse", "--hisparse-config", '{"device_buffer_size": 64, "num_recent_slots": 4}')
MAX_TOKENS = 8
# A chat system message of about 200 tokens once templated (the shared prefix of the chat requests: 202 tokens).
SYSTEM = " ".join(f"w{(j * 13) % 97}" for j in range(70))


def _ids(seed: int, n: int) -> list[int]:
    """A token-id prompt of its own (`seed`): no two tests share a page."""
    return [(seed * 131 + 7 * i) % 1000 + 5 for i in range(n)]


@pytest.fixture(scope="module", params=["dense", "hisparse"])
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    extra = HISPARSE_ARGS if request.param == "hisparse" else ()
    s = ServerProcess("--enable-prefix-caching", *extra, api_key=API_KEY).wait_ready()
    try:
        yield s
    finally:
        s.kill()


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _complete(server: ServerProcess, prompt: list[int], max_tokens: int = MAX_TOKENS):
    return _client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                              extra_body={"ignore_eos": True})


def _cached(out) -> int:
    details = out.usage.prompt_tokens_details
    assert details is not None, out.usage
    return details.cached_tokens


def _expected(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[str]:
    return [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                 ignore_eos=True))]


def test_shared_prefix_reuses_whole_pages(server: ServerProcess, offline_llm: LLM) -> None:
    prefix = _ids(1, 200)
    a, b = prefix + _ids(2, 5), prefix + _ids(3, 9)
    first, second, again = _complete(server, a), _complete(server, b), _complete(server, b)
    assert _cached(first) == 0
    assert _cached(second) == 3 * PAGE  # the 200 shared tokens: 3 whole pages
    assert _cached(again) == 3 * PAGE  # b is cached to its own last full page, the shared ones come first anyway
    assert second.usage.prompt_tokens == len(b) and second.usage.total_tokens == len(b) + MAX_TOKENS
    # the cached prefix's KV is what the prompt would have computed: greedy texts equal the offline engine's
    assert [o.choices[0].text for o in (first, second, again)] == _expected(offline_llm, [a, b, b])

    # the prompt's last token is always computed: a prompt of exactly one page plus that token reuses the page...
    page_and_one = _ids(4, PAGE + 1)
    assert _cached(_complete(server, page_and_one)) == 0
    assert _cached(_complete(server, page_and_one)) == PAGE
    # ...and one of a single page cannot reuse it (only whole pages before the last token)
    assert _cached(_complete(server, page_and_one[:PAGE])) == 0


def test_chat_and_streamed_usage_report_cached_tokens(server: ServerProcess) -> None:
    client = _client(server)

    def chat(question: str, **kwargs: object):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                              **kwargs)

    first = chat("Question one?")
    second = chat("And a second question, longer?")
    assert _cached(first) == 0 and _cached(second) == 3 * PAGE  # 202 shared tokens (template and system message)
    chunks = list(chat("And a second question, longer?", stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    assert usage.prompt_tokens == second.usage.prompt_tokens and _cached(chunks[-1]) == 3 * PAGE
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == second.choices[0].message.content

    # completions, streamed: the usage chunk too
    prompt = _ids(5, 150)
    _complete(server, prompt)
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    last = list(stream)[-1]
    assert last.usage.completion_tokens == 3 and _cached(last) == 2 * PAGE


def test_running_request_shares_its_prompt_and_keeps_it_through_a_flush(server: ServerProcess,
                                                                        offline_llm: LLM) -> None:
    """A prompt's full pages join the cache when its prefill ends: a request admitted while the first still decodes
    reuses them, and /flush_cache cannot drop pages a running request maps."""
    wait_until_idle(server)
    flush_cache(server)
    prefix = _ids(6, 140)
    long_body = {"model": MODEL, "prompt": prefix + [11], "max_tokens": 100, "temperature": 0, "ignore_eos": True,
                 "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=long_body, headers=server.headers,
                      timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):  # its first token: the prefill is done
            pass
        assert flush_cache(server)["dropped_tokens"] == 0  # its two pages are mapped: kept
        shared = _complete(server, prefix + [12, 13])
        assert server.stats()["num_running_reqs"] == 1, "the long request ended too early for this test"
    # the client left: the long request is aborted; its pages are the cache's now
    assert _cached(shared) == 2 * PAGE
    assert shared.choices[0].text == _expected(offline_llm, [prefix + [12, 13]])[0]
    cache = wait_until_idle(server)["prefix_cache"]
    assert cache["cached_tokens"] == cache["evictable_tokens"] >= 2 * PAGE


def test_metrics_flush_and_recompute(server: ServerProcess) -> None:
    prompt = _ids(7, 130)
    _complete(server, prompt)
    assert _cached(_complete(server, prompt)) == 2 * PAGE  # at least one hit, whatever ran before
    stats = wait_until_idle(server)
    cache = stats["prefix_cache"]
    assert cache["hit_tokens"] > 0 and cache["queried_tokens"] >= cache["hit_tokens"]

    metrics = metric_values(server)
    assert metrics["sglang:cache_hit_rate"] == pytest.approx(cache["hit_tokens"] / cache["queried_tokens"])
    assert 0 < metrics["sglang:cache_hit_rate"] < 1
    assert metrics["sglang:cached_tokens_total"] == cache["hit_tokens"]
    assert metrics["hisparse:prefix_cache_tokens"] == cache["cached_tokens"] > 0
    assert metrics["hisparse:prefix_cache_evictable_tokens"] == cache["evictable_tokens"] == cache["cached_tokens"]
    assert metrics["hisparse:prefix_cache_evicted_tokens_total"] == cache["evicted_tokens"]
    # A router's /load counts the cache's unused pages as free (they are given back when a pool runs short).
    load = httpx.get(server.url + "/load", timeout=10).json()
    for pool in ("host_pages", "dense_kv_slots"):
        assert load[f"{pool}_free"] == load[f"{pool}_total"], load

    # the key is needed, as on every path but the open ones
    assert httpx.post(server.url + "/flush_cache", timeout=10).status_code == 401
    flushed = flush_cache(server)
    assert flushed == {"prefix_caching": True, "dropped_tokens": cache["cached_tokens"]}
    after = server.stats()
    assert after["prefix_cache"]["cached_tokens"] == 0 and after["prefix_cache"]["evictable_tokens"] == 0
    assert after["prefix_cache"]["evicted_tokens"] == cache["evicted_tokens"] + cache["cached_tokens"]
    assert after["prefix_cache"]["hit_tokens"] == cache["hit_tokens"]  # the counters stay
    pools = [after[k]["used"] for k in ("host_pages", "device_slots", "indexer_slots", "dense_kv_slots")]
    assert not any(pools), after  # the cache's pages went back to the pools
    assert metric_values(server)["hisparse:prefix_cache_tokens"] == 0
    assert flush_cache(server)["dropped_tokens"] == 0  # nothing left

    assert _cached(_complete(server, prompt)) == 0  # computed again after the flush...
    assert _cached(_complete(server, prompt)) == 2 * PAGE  # ...and cached again


def test_without_the_flag_nothing_changes(dense_server: ServerProcess) -> None:
    """The shared server (no --enable-prefix-caching): usage has the three counts only, /flush_cache answers that
    caching is off, and /metrics has no cache metrics."""
    body = {"model": MODEL, "prompt": _ids(8, 130), "max_tokens": 3, "temperature": 0}
    for _ in range(2):
        r = httpx.post(dense_server.url + "/v1/completions", json=body, headers=dense_server.headers, timeout=60)
        assert r.status_code == 200 and set(r.json()["usage"]) == {"prompt_tokens", "completion_tokens",
                                                                    "total_tokens"}, r.text
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", dense_server.url + "/v1/chat/completions", json=chat, headers=dense_server.headers,
                      timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert '"usage":{' in lines[-1] and "prompt_tokens_details" not in lines[-1]
    assert httpx.post(dense_server.url + "/flush_cache", timeout=10).status_code == 401
    assert flush_cache(dense_server) == {"prefix_caching": False, "dropped_tokens": 0}
    assert dense_server.stats()["prefix_cache"] is None
    names = set(metric_values(dense_server))
    assert "sglang:generation_tokens_total" in names
    assert not {n for n in names if "cache_hit_rate" in n or "cached_tokens" in n or "prefix_cache" in n}, names


def test_flags_map_to_the_config() -> None:
    from decode_server.cli import build_parser, engine_config_from_args

    def config(*argv: str):
        return engine_config_from_args(build_parser().parse_args(["serve", *argv]))

    assert not config().enable_prefix_caching  # off by default
    assert config("--enable-prefix-caching").enable_prefix_caching
    assert not config("--disable-radix-cache").enable_prefix_caching  # SGLang's flag: accepted, already the default


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--enable-prefix-caching", "--disable-radix-cache"],
         "--enable-prefix-caching and --disable-radix-cache contradict each other"),
        (["generate", "--enable-prefix-caching", "--disable-radix-cache", "--prompt", "x"], "contradict each other"),
    ],
)
def test_prefix_caching_flags_are_validated(argv: list[str], message: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from decode_server.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
