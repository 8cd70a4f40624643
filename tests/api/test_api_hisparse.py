"""A HiSparse-mode server (`--enable-hisparse`): greedy outputs equal the dense offline engine's, swap-ins
really happen (misses > 0 in /metrics), and the host pool and device buffers are empty again afterwards.
Its teardown kills the api process outright and checks that the engine process dies with it.

A tiny-glm5 server with the speculative prefetch on: greedy outputs equal dense's, and /metrics carries the bets'
payoff gauge for full layer 2 only, equal to its shared follower's misses minus its own in the same scrape."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest
from api_server_harness import CONTEXT_LENGTH, ServerProcess, assert_no_orphans, wait_until_idle
from prometheus_client.parser import text_string_to_metric_families

from decode_server.engine.llm import LLM
from decode_server.engine.sampling_params import SamplingParams

MODEL = "tiny-dsa"
# device_buffer_size == the model's index_topk (64): prompts longer than that must swap rows in from the host.
HISPARSE_CONFIG = '{"device_buffer_size": 64, "num_recent_slots": 4}'
PROMPTS = [" ".join(f"w{(i * 31 + j) % 97}" for j in range(24 + 3 * i)) for i in range(8)]


@pytest.fixture(scope="module")
def hisparse_server() -> Iterator[ServerProcess]:
    server = ServerProcess("--enable-hisparse", "--hisparse-config", HISPARSE_CONFIG).wait_ready()
    try:
        yield server
    finally:
        # SIGTERM and SIGINT are covered elsewhere; here the api process dies abruptly (SIGKILL): the engine
        # process must not outlive it (parent-death signal), nor may any other child.
        try:
            server.proc.kill()
            server.proc.wait(10)
            assert_no_orphans(server)
        finally:
            server.kill()


def _samples(server: ServerProcess) -> list:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def test_hisparse_greedy_equals_dense(hisparse_server: ServerProcess, offline_llm: LLM) -> None:
    dense = offline_llm
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = dense.generate(PROMPTS, params)
    assert all(len(o.prompt_token_ids) + 12 > 64 for o in expected), "prompts too short to need swap-ins"

    async def run_all() -> list[str]:
        client = openai.AsyncOpenAI(
            base_url=hisparse_server.url + "/v1", api_key="none", max_retries=0, timeout=300
        )
        async with client:
            outs = await asyncio.gather(
                *(client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True}) for p in PROMPTS)
            )  # fmt: skip
        return [o.choices[0].text for o in outs]

    got = asyncio.run(run_all())
    assert got == [o.text for o in expected]

    samples = _samples(hisparse_server)
    misses = sum(s.value for s in samples if s.name == "hisparse:swap_in_misses_total")
    hits = sum(s.value for s in samples if s.name == "hisparse:swap_in_hits_total")
    layers = {s.labels["layer"] for s in samples if s.name == "hisparse:swap_in_misses_total"}
    assert misses > 0 and hits > 0 and len(layers) >= 1
    assert any(s.name == "hisparse:enabled" and s.value == 1.0 for s in samples)
    assert any(s.name == "hisparse:host_pool_total_pages" and s.value > 0 for s in samples)
    assert any(s.name == "hisparse:bytes_h2d_total" and s.value > 0 for s in samples)

    stats = wait_until_idle(hisparse_server)
    assert stats["host_pages"]["used"] == 0 and stats["device_slots"]["used"] == 0
    assert stats["host_pages"]["total"] > 0 and stats["device_slots"]["total"] > 0


@pytest.fixture(scope="module")
def glm5_bets_server() -> Iterator[ServerProcess]:
    config = '{"device_buffer_size": 64, "num_recent_slots": 4, "speculative_prefetch": true}'
    server = ServerProcess("--model-path", "tiny-glm5", "--enable-hisparse", "--hisparse-config", config).wait_ready()
    try:
        yield server
    finally:
        server.kill()


def test_glm5_bets_report_their_payoff(glm5_bets_server: ServerProcess) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [o.text for o in LLM("tiny-glm5", device="cpu", context_length=CONTEXT_LENGTH).generate(PROMPTS, params)]
    client = openai.OpenAI(base_url=glm5_bets_server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    got = [client.completions.create(model="tiny-glm5", prompt=p, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
    assert got == expected
    wait_until_idle(glm5_bets_server)
    samples = _samples(glm5_bets_server)
    misses = {s.labels["layer"]: s.value for s in samples if s.name == "hisparse:swap_in_misses_total"}
    saved = {s.labels["layer"]: s.value for s in samples if s.name == "hisparse:speculative_prefetch_rows_saved"}
    bets = {s.labels["layer"]: s.value for s in samples if s.name == "hisparse:speculative_prefetch_misses_total"}
    assert misses["3"] > 0 and bets["2"] > 0  # the follower missed and the bets on layer 2 copied rows
    assert saved == {"2": misses["3"] - misses["2"]}  # only layer 2 is bet on and has a follower (layer 3)
