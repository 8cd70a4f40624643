"""Batch-invariant mode (`enable_deterministic_inference`) in the engine: fixed prefill split points, row-tiled
ops whose result for a row does not depend on the other rows, and (GPU, marked `gpu`) requests alone = batched.

The end-to-end CPU check through the real server is tests/api/test_api_deterministic.py.
"""

from __future__ import annotations

import pytest
import torch

from decode_server.engine.sampling_params import SamplingParams
from decode_server.model import batch_invariant
from decode_server.model.batch_invariant import batch_invariant_mode


def _prefill_chunks(engine, lengths: list[int]) -> list[tuple[str, int, int]]:
    chunks: list[tuple[str, int, int]] = []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        if batch is not None and not batch.is_decode:
            chunks.extend((r.rid, p, e) for r, p, e in zip(batch.requests, batch.prefix_lens, batch.extend_lens,
                                                           strict=True))
        return batch

    engine.scheduler.schedule = recording
    for i, n in enumerate(lengths):
        engine.add_request(f"r{i}", list(range(2, 2 + n)), SamplingParams(max_tokens=2, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    return chunks


def test_prefill_split_points_fixed_per_request(make_engine) -> None:
    lengths = [100, 30, 150]
    fixed = _prefill_chunks(make_engine(chunked_prefill_size=64, enable_deterministic_inference=True), lengths)
    for rid, prefix, extend in fixed:
        assert prefix % 64 == 0 and extend == min(64, lengths[int(rid[1:])] - prefix)
    assert sum(e for _, _, e in fixed) == sum(lengths)
    # Without the flag the shared token budget cuts prompts wherever it runs out.
    shared = _prefill_chunks(make_engine(chunked_prefill_size=64), lengths)
    assert any(prefix % 64 for _, prefix, _ in shared)


def test_row_tiled_ops_do_not_depend_on_other_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 300, generator=gen), torch.randn(500, 300, generator=gen)
    a, b = torch.randn(4, 37, 64, generator=gen), torch.randn(4, 64, 96, generator=gen)
    with batch_invariant_mode():
        assert batch_invariant.enabled()
        full, part = batch_invariant.linear(x, w), batch_invariant.linear(x[5:6], w)
        assert full.shape == (37, 500) and torch.equal(full[5:6], part)
        assert torch.equal(batch_invariant.batched_matmul(a, b)[:, 3:4], batch_invariant.batched_matmul(a[:, 3:4], b))
        assert torch.equal(batch_invariant.matmul_rows(x[:, :256], w[:64, :64].T.contiguous(), 4)[9],
                           batch_invariant.matmul_rows(x[9:10, :256], w[:64, :64].T.contiguous(), 4)[0])
        assert batch_invariant.linear(x[:0], w).shape == (0, 500)
    assert not batch_invariant.enabled()
    torch.testing.assert_close(batch_invariant.linear(x, w), x @ w.T)


@pytest.mark.gpu
@pytest.mark.parametrize("hisparse", [False, True])
def test_gpu_alone_equals_batched(hisparse: bool) -> None:
    """16 requests of ~512 tokens on CUDA (bf16, Triton kernels): tokens and logprobs alone = all 16 batched,
    greedy and seeded sampling; HiSparse outputs equal dense ones (checked against the dense run's file)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from decode_server.engine.llm import LLM

    llm = LLM("tiny-dsa", device="cuda", enable_deterministic_inference=True, enable_hisparse=hisparse,
              chunked_prefill_size=256, hisparse={"device_buffer_size": 128})
    gen = torch.Generator().manual_seed(15)
    prompts = [torch.randint(2, 1024, (500 + 2 * i,), generator=gen).tolist() for i in range(16)]
    params = [SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1,
                             **({"temperature": 0.9, "seed": 1000 + i} if i % 2 else {"temperature": 0.0}))
              for i in range(16)]

    def key(out):
        return out.token_ids, [lp.logprob for lp in out.logprobs]

    alone = [key(llm.generate([p], s)[0]) for p, s in zip(prompts, params, strict=True)]
    batched = [key(o) for o in llm.generate(prompts, params)]
    assert batched == alone
