"""`--enable-deterministic-inference` through the real server: 16 requests give the same tokens and
bit-identical logprobs whether each runs alone or all 16 run concurrently (batched decode, chunked prefill
sharing passes), in dense and in HiSparse mode; seeded sampling (temperature > 0) gives the same text too.

Prompts of 100-130 tokens (past index_topk and the HiSparse buffer, 2-3 prefill chunks each) run in `make test`;
the issue's ~512-token prompts (8 chunks each) are `slow` (about 4x the CPU time: on this shared 2-core machine
the 512-token run did not finish within pytest's 600 s limit while other jobs ran).

Without the flag the same comparison finds differences: the GEMM shapes, hence the float rounding of each row,
follow the batch (measured with this file's slow test: logprobs of 16 of 16 requests differed in some bit, tokens
of none, on tiny-dsa CPU).
That check is `slow` (it needs a third server) and asserts only that some logprob differs, which is what
batching does but is not guaranteed to do on every machine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import openai
import pytest
import torch
from api_server_harness import ServerProcess, wait_until_idle

MODEL = "tiny-dsa"
NUM_REQUESTS = 16
MAX_TOKENS = 3
PROMPT_LEN = 100  # 100..130 tokens: past index_topk (64) and the HiSparse buffer (64), 2-3 prefill chunks
# Prompts are cut into 64-token chunks; 16 of them exceed one pass's budget, so concurrent prefill passes mix
# requests (and, without fixed split points, would cut prompts elsewhere than alone).
ARGS = ("--context-length", "1024", "--chunked-prefill-size", "64", "--page-size", "16")
DETERMINISTIC = ("--enable-deterministic-inference",)
HISPARSE = ("--enable-hisparse", "--hisparse-config", '{"device_buffer_size": 64, "num_recent_slots": 4}')


def _requests(prompt_len: int) -> list[dict]:
    gen = torch.Generator().manual_seed(15)
    out = []
    for i in range(NUM_REQUESTS):
        prompt = torch.randint(2, 1024, (prompt_len + 2 * i,), generator=gen).tolist()
        # Odd requests sample (temperature 0.9) with their own seed; even ones are greedy.
        sampling = {"temperature": 0.9, "seed": 1000 + i} if i % 2 else {"temperature": 0.0}
        out.append({"prompt": prompt, "max_tokens": MAX_TOKENS, "logprobs": 1, **sampling,
                    "extra_body": {"ignore_eos": True}})
    return out


def _result(choice) -> tuple[str, list[str], list[float]]:
    return choice.text, list(choice.logprobs.tokens), list(choice.logprobs.token_logprobs)


def _client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=900)


def run_alone(server: ServerProcess, requests: list[dict]) -> list[tuple]:
    async def go() -> list[tuple]:
        async with _client(server) as client:
            return [_result((await client.completions.create(model=MODEL, **r)).choices[0]) for r in requests]

    return asyncio.run(go())


def run_concurrently(server: ServerProcess, requests: list[dict]) -> list[tuple]:
    async def go() -> list[tuple]:
        async with _client(server) as client:
            outs = await asyncio.gather(*(client.completions.create(model=MODEL, **r) for r in requests))
            return [_result(o.choices[0]) for o in outs]

    return asyncio.run(go())


@contextlib.contextmanager
def _server(*args: str) -> Iterator[ServerProcess]:
    server = ServerProcess(*ARGS, *args)
    try:
        yield server.wait_ready()
    finally:
        server.stop()
        server.kill()


@pytest.fixture(scope="module")
def deterministic_dense() -> Iterator[ServerProcess]:
    with _server(*DETERMINISTIC) as server:
        yield server


@pytest.fixture(scope="module")
def deterministic_hisparse() -> Iterator[ServerProcess]:
    with _server(*DETERMINISTIC, *HISPARSE) as server:
        yield server


@pytest.fixture(scope="module")
def alone(deterministic_dense) -> list[tuple]:
    """Each request run by itself on the deterministic dense server: the reference of the tests below."""
    results = run_alone(deterministic_dense, _requests(PROMPT_LEN))
    assert all(len(lp) == MAX_TOKENS for _, _, lp in results)
    assert len({text for text, _, _ in results}) > NUM_REQUESTS // 2  # prompt- and seed-dependent outputs
    return results


@pytest.mark.timeout(1200)
def test_dense_batched_equals_alone(deterministic_dense, alone) -> None:
    assert run_concurrently(deterministic_dense, _requests(PROMPT_LEN)) == alone
    wait_until_idle(deterministic_dense)


@pytest.mark.timeout(1200)
def test_hisparse_batched_equals_alone(deterministic_hisparse, alone) -> None:
    """HiSparse (bit-identical to dense by contract) is batch-invariant too: all 16 concurrently = dense alone."""
    assert run_concurrently(deterministic_hisparse, _requests(PROMPT_LEN)) == alone
    wait_until_idle(deterministic_hisparse)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_512_token_prompts_alone_equal_batched(deterministic_dense, deterministic_hisparse) -> None:
    """The issue's size: 16 requests of ~512 tokens (8 prefill chunks each)."""
    requests = _requests(500)
    reference = run_alone(deterministic_dense, requests)
    assert run_concurrently(deterministic_dense, requests) == reference
    assert run_concurrently(deterministic_hisparse, requests) == reference


@pytest.mark.slow
def test_without_the_flag_batching_changes_logprobs() -> None:
    """The comparison above is sensitive: without the flag, running concurrently changes some logprob bits."""
    requests = _requests(PROMPT_LEN)
    with _server() as server:
        alone = run_alone(server, requests)
        batched = run_concurrently(server, requests)
        differing = sum(a[2] != b[2] for a, b in zip(alone, batched, strict=True))
        print(f"without --enable-deterministic-inference: {differing}/{NUM_REQUESTS} requests' logprobs differ, "
              f"{sum(a[1] != b[1] for a, b in zip(alone, batched, strict=True))} requests' tokens differ")
        assert differing > 0
