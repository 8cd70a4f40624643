"""PD on the GPU: CUDA prefill (dense KV in device memory, sent over mooncake TCP) and CUDA HiSparse decode
(rows land in its pinned host pool), against a colocated CUDA HiSparse server: greedy tokens and logprobs equal,
one request at a time. Run on the GPU machine with `pytest -m gpu tests/disagg`."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import openai
import pytest
import torch
from pd_harness import (
    HISPARSE_CONFIG,
    MODEL,
    SMALL_POOLS,
    PrefillServer,
    ServerProcess,
    decode_server,
    start_all,
    wait_pd_idle,
    wait_until_idle,
)

pytestmark = pytest.mark.gpu
CUDA = ["--device", "cuda"]
PROMPTS = [[(13 * i + 5 * n) % 900 + 5 for i in range(n)] for n in (7, 90, 200)]
_rooms = itertools.count(90_000)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict]:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    prefill = PrefillServer(*CUDA)
    decode = decode_server(*CUDA, hisparse=True)
    colocated = ServerProcess(*CUDA, *SMALL_POOLS, "--enable-hisparse", "--hisparse-config", HISPARSE_CONFIG)
    everyone = [prefill, decode, colocated]
    start_all(*everyone)
    try:
        yield {"prefill": prefill, "decode": decode, "colocated": colocated}
    finally:
        for s in everyone:
            s.kill()


async def _complete(server, body: dict):
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        return await c.completions.create(**body)


def test_pd_on_cuda_equals_colocated(servers):
    prefill, decode, colocated = servers["prefill"], servers["decode"], servers["colocated"]
    for prompt in PROMPTS:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 2,
                "extra_body": {"ignore_eos": True}}
        expected = asyncio.run(_complete(colocated, body))
        body["extra_body"].update(prefill.route(next(_rooms)))

        async def pd(body=body):
            return await asyncio.gather(_complete(prefill, body), _complete(decode, body))

        _, got = asyncio.run(pd())
        assert got.choices[0].text == expected.choices[0].text
        assert got.choices[0].logprobs.token_logprobs == expected.choices[0].logprobs.token_logprobs
    wait_pd_idle(prefill)
    wait_pd_idle(decode)
    wait_until_idle(colocated)
