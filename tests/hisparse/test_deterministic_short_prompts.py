"""`--enable-deterministic-inference` on CPU with short prompts, `logprobs` and mixed arrivals.

This found a hole: seven requests of 20–109 prompt tokens, run alone and then together, gave equal tokens, but two
of them differed in the last bit of a top-2 logprob from their 4th output token on. The cause was the MoE router.
Its sigmoid ran over the unpadded [T, 8] logits, and a CPU element-wise kernel rounds a vectorized body and a
scalar tail differently, with the tail's start set by the tensor's size. The routing now runs on the same 64-row
tiles as the GEMMs (`batch_invariant.on_row_tiles_pair`). On the old code this test fails, in about 12 s.
"""

from __future__ import annotations

import random

import torch
from harness import make_engine, random_prompt
from test_overlap import Job, drive

from decode_server.engine.sampling_params import SamplingParams


def test_short_prompts_alone_equal_batched(tiny_cpu) -> None:
    gen = torch.Generator().manual_seed(7)
    rng = random.Random(7)
    prompts = [random_prompt(gen, rng.randrange(8, 140)) for _ in range(7)]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)

    def run(jobs: list[Job]) -> dict:
        return drive(make_engine(tiny_cpu, hisparse=False, overlap=False, deterministic=True), jobs)

    alone: dict = {}
    for i, prompt in enumerate(prompts):
        alone.update(run([Job(0, f"j{i}", prompt, params)]))
    order = list(range(len(prompts)))
    random.Random(3).shuffle(order)
    staggered = [Job(k % 4, f"j{i}", prompts[i], params) for k, i in enumerate(order)]
    for jobs in ([Job(0, f"j{i}", p, params) for i, p in enumerate(prompts)], staggered):
        together = run(jobs)
        for rid, outcome in together.items():
            assert outcome.tokens == alone[rid].tokens, rid
            assert outcome.logprobs == alone[rid].logprobs, f"{rid}: logprobs differ between alone and batched"
