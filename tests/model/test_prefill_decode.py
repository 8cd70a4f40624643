"""Prefill, chunked prefill and token-by-token decode give the same logits (tiny-dsa, float32, DenseBackend)."""

from __future__ import annotations

import pytest
import torch
from dsa_test_helpers import dense_backend, forward_tokens

from decode_server.model import load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("HISPARSE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    model, config = load_model("tiny-dsa", "cpu", torch.float32)
    yield model, config
    mp.undo()


def test_prefill_then_decode_equals_one_by_one(tiny) -> None:
    model, config = tiny
    length = 80  # > index_topk (64): the later tokens attend sparsely
    assert length > config.index_topk
    prompt = torch.randint(2, 1000, (length + 1,), generator=torch.Generator().manual_seed(0)).tolist()

    backend = dense_backend(config)
    for row in (0, 1, 2):
        backend.reserve(row, length + 1)

    # Request 0: whole prompt in one pass, then one decode step.
    prefill = model.compute_logits(forward_tokens(model, backend, [0], [0], [prompt[:length]]))
    decode = model.compute_logits(forward_tokens(model, backend, [0], [length], [[prompt[length]]]))
    # Request 1: one token per pass.
    one_by_one = [model.compute_logits(forward_tokens(model, backend, [1], [p], [[prompt[p]]]))[0]
                  for p in range(length + 1)]
    # Request 2: two prefill chunks of uneven size, then the decode step batched with nothing else.
    forward_tokens(model, backend, [2], [0], [prompt[:37]])
    chunked = model.compute_logits(forward_tokens(model, backend, [2], [37], [prompt[37:length]]))

    torch.testing.assert_close(prefill[-1], one_by_one[length - 1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decode[0], one_by_one[length], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(chunked[-1], prefill[-1], rtol=1e-4, atol=1e-4)
    # Every position, not just the last, agrees between the one-pass prefill and the token-by-token run.
    torch.testing.assert_close(prefill, torch.stack(one_by_one[:length]), rtol=1e-4, atol=1e-4)


def test_batched_requests_do_not_interact(tiny) -> None:
    model, config = tiny
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(2, 1000, (70,), generator=gen).tolist()
    b = torch.randint(2, 1000, (20,), generator=gen).tolist()
    backend = dense_backend(config)
    for row in (3, 5, 6):
        backend.reserve(row, 80)
    both = model.compute_logits(forward_tokens(model, backend, [3, 5], [0, 0], [a, b]))
    alone = model.compute_logits(forward_tokens(model, backend, [6], [0], [b]))
    torch.testing.assert_close(both[70:], alone, rtol=1e-4, atol=1e-4)
