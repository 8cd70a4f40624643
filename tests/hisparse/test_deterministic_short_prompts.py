"""A known hole in `--enable-deterministic-inference` on CPU, kept as a strict xfail so that its fix shows.

Seven requests with prompts of 20–109 tokens and `logprobs=2`, on the dense backend, run once each alone and then
all together. The greedy tokens and the chosen tokens' logprobs agree, but in two requests a top-2 alternative's
logprob differs in the last bit (e.g. -4.492654800 against -4.492654324, from the 4th output token on). It still
differs with `batch_invariant.ROW_TILE = 1` and with one thread. So the cause is not the row position within a
64-row GEMM tile, and it is not yet found. The 16 × ~512-token alone-vs-batched tests (tests/api, and tests/engine
on the GPU) pass. Marked slow: about 20 s on CPU.
"""

from __future__ import annotations

import random

import pytest
import torch
from harness import make_engine, random_prompt
from test_overlap import Job, drive

from decode_server.engine.sampling_params import SamplingParams


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError, reason="CPU deterministic mode: last-bit top_logprobs difference, cause not found")
def test_short_prompts_alone_equal_batched(tiny_cpu) -> None:
    gen = torch.Generator().manual_seed(7)
    rng = random.Random(7)
    prompts = [random_prompt(gen, rng.randrange(8, 140)) for _ in range(7)]

    def run(indices: list[int]) -> dict:
        params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
        jobs = [Job(0, f"j{i}", prompts[i], params) for i in indices]
        return drive(make_engine(tiny_cpu, hisparse=False, overlap=False, deterministic=True), jobs)

    alone: dict = {}
    for i in range(len(prompts)):
        alone.update(run([i]))
    together = run(list(range(len(prompts))))
    for rid, outcome in together.items():
        assert outcome.tokens == alone[rid].tokens, rid
        assert outcome.logprobs == alone[rid].logprobs, f"{rid}: logprobs differ between alone and batched"
