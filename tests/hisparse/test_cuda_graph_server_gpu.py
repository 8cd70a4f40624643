"""CUDA graphs on the real server (`decode-server serve --device cuda`, HiSparse): a server with graphs (captured at
start, logged) and one with `--disable-cuda-graph` give the same greedy tokens for the same prompts sent one at a
time; the graph server then serves a concurrent batch and returns to idle with every pool empty.
Run: pytest -m gpu tests/hisparse/test_cuda_graph_server_gpu.py -v"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import openai
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))

from api_server_harness import ServerProcess, wait_until_idle  # noqa: E402

pytestmark = pytest.mark.gpu

ARGS = ["--device", "cuda", "--enable-hisparse", "--hisparse-config", '{"device_buffer_size": 64, "num_recent_slots": 4}',
        "--device-kv-budget", "64MiB", "--host-kv-budget", "128MiB", "--page-size", "16",
        "--max-running-requests", "8"]
PROMPTS = [[(13 * i + 5 * n) % 900 + 5 for i in range(n)] for n in (7, 40, 90, 130, 170, 200)]


async def _complete(server: ServerProcess, prompt: list[int], max_tokens: int = 24):
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        return await c.completions.create(model="tiny-dsa", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          logprobs=1, extra_body={"ignore_eos": True})


def test_server_with_and_without_graphs() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    graphs = ServerProcess(*ARGS)
    eager = ServerProcess(*ARGS, "--disable-cuda-graph")
    try:
        graphs.wait_ready()
        eager.wait_ready()
        assert "captured 4 decode CUDA graphs (batch sizes [1, 2, 4, 8])" in graphs.log_text(), graphs.log_text()
        assert "CUDA graphs off: --disable-cuda-graph" in eager.log_text(), eager.log_text()
        for prompt in PROMPTS:  # one at a time: batch 1 in both servers
            got = asyncio.run(_complete(graphs, prompt))
            expected = asyncio.run(_complete(eager, prompt))
            assert got.choices[0].text == expected.choices[0].text, f"prompt of {len(prompt)} tokens"
            diff = max(abs(a - b) for a, b in zip(got.choices[0].logprobs.token_logprobs,
                                                   expected.choices[0].logprobs.token_logprobs, strict=True))
            print(f"prompt of {len(prompt)} tokens: same text; largest logprob difference {diff:.3e}")

        async def batch():
            return await asyncio.gather(*(_complete(graphs, p, 40) for p in PROMPTS * 2))

        outs = asyncio.run(batch())
        assert all(len(o.choices[0].logprobs.token_logprobs) == 40 for o in outs)
        wait_until_idle(graphs)
        wait_until_idle(eager)
    finally:
        graphs.kill()
        eager.kill()
