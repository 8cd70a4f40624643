"""Prompt logprobs (SamplingParams.prompt_logprobs; engine/prompt_logprobs.py): each prompt token's logprob equals the
one a decode step reports for that token after the same prefix (forced with logit_bias, which leaves logprobs
untouched), the best alternatives too; chunking the prefill does not change them beyond rounding; HiSparse == dense
bit for bit; a cached prefix is not used for such a request; a PD decode server refuses them."""

from __future__ import annotations

import pytest
import torch

from decode_server.engine.llm import LLM
from decode_server.engine.sampling_params import SamplingParams
from decode_server.errors import InvalidRequestError

PROMPT = [(7 * i) % 900 + 5 for i in range(40)]
ATOL = 1e-4  # a prefill row against a one-row decode step: other GEMM shapes, other rounding


def _prompt_logprobs(llm: LLM, prompt: list[int], top: int = 2):
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=top))
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    return out.prompt_logprobs


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-dsa", device="cpu", context_length=256, chunked_prefill_size=128)


def test_each_prompt_token_as_a_decode_step_sees_it(llm: LLM) -> None:
    got = _prompt_logprobs(llm, PROMPT)
    for i in (1, 8, 21, 39):
        token = PROMPT[i]
        (forced,) = llm.generate([PROMPT[:i]], SamplingParams(max_tokens=1, temperature=0, logprobs=2,
                                                               logit_bias={token: 100.0}))  # fmt: skip
        expected = forced.logprobs[0]
        assert forced.token_ids == [token] and got[i].token_id == token
        assert got[i].logprob == pytest.approx(expected.logprob, abs=ATOL), i
        assert [t for t, _ in got[i].top_logprobs] == [t for t, _ in expected.top_logprobs], i
        assert [v for _, v in got[i].top_logprobs] == pytest.approx([v for _, v in expected.top_logprobs], abs=ATOL)


def test_chunking_does_not_change_them(llm: LLM) -> None:
    whole = _prompt_logprobs(llm, PROMPT, top=0)
    chunked = _prompt_logprobs(LLM("tiny-dsa", device="cpu", context_length=256, chunked_prefill_size=16), PROMPT,
                               top=0)  # fmt: skip
    assert [x.token_id for x in whole[1:]] == [x.token_id for x in chunked[1:]] == PROMPT[1:]
    assert all(x.top_logprobs == [] for x in whole[1:])
    torch.testing.assert_close(torch.tensor([x.logprob for x in chunked[1:]]),
                               torch.tensor([x.logprob for x in whole[1:]]), atol=ATOL, rtol=0)


def test_hisparse_equals_dense_bit_for_bit(llm: LLM) -> None:
    long_prompt = [(11 * i) % 900 + 5 for i in range(150)]  # longer than the device buffer and index_topk (64)
    hisparse = LLM("tiny-dsa", device="cpu", context_length=256, chunked_prefill_size=128, enable_hisparse=True,
                   hisparse={"device_buffer_size": 64, "num_recent_slots": 4})  # fmt: skip
    dense = _prompt_logprobs(llm, long_prompt, top=3)
    assert _prompt_logprobs(hisparse, long_prompt, top=3) == dense


def test_a_cached_prefix_is_not_used() -> None:
    prompt = [(13 * i) % 900 + 5 for i in range(150)]  # two full pages of 64 tokens to cache
    cached = LLM("tiny-dsa", device="cpu", context_length=256, enable_prefix_caching=True)
    cached.generate([prompt], SamplingParams(max_tokens=2, temperature=0))
    assert cached.engine.kv.cached_prefix_tokens(prompt) == 128  # a plain request would start after these
    first = _prompt_logprobs(cached, prompt)  # every position computed: no entry missing
    assert first == _prompt_logprobs(LLM("tiny-dsa", device="cpu", context_length=256), prompt)


def test_a_pd_decode_server_refuses_them(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="PD decode") as exc:
        llm.engine.add_request("pd", PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=0), remote_prefill=True)
    assert exc.value.param == "prompt_logprobs"
    assert llm.engine.is_idle_and_empty()


def test_dp_attention_refuses_them(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """With DP attention each rank's LM head would run its own number of prompt rows through the shared collectives
    (the check itself; DP ranks are tests/parallel's)."""
    monkeypatch.setattr(llm.engine, "dp_attention", True)
    with pytest.raises(InvalidRequestError, match="data-parallel attention") as exc:
        llm.engine.add_request("dp", PROMPT, SamplingParams(max_tokens=2, prompt_logprobs=0))
    assert exc.value.param == "prompt_logprobs"
