"""GPU: `build_random_model` creates DeepSeek-V3.2-sized layers (configs/dsv32-bench.json) on the device in bf16
quickly, and they run prefill + decode through the dense backend (sparse beyond index_topk 2048)."""

from __future__ import annotations

import time

import pytest
import torch
from dsa_test_helpers import dense_backend, forward_tokens

from decode_server.model import build_random_model, load_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_BUILD_SECONDS = 60.0


def test_bench_model_builds_fast_on_device_and_runs() -> None:
    config = load_config("dsv32-bench")
    torch.cuda.synchronize()
    start = time.monotonic()
    model = build_random_model(config, "cuda", torch.bfloat16, seed=0)
    torch.cuda.synchronize()
    seconds = time.monotonic() - start
    params = sum(p.numel() for p in model.parameters())
    print(f"dsv32-bench: {params / 1e9:.2f} B parameters built on cuda in {seconds:.1f} s, "
          f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB peak")
    assert seconds < MAX_BUILD_SECONDS
    assert model.model.layers[0].self_attn.q_b_proj.weight.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.q_b_proj.weight.device.type == "cuda"

    length = 3000  # > index_topk 2048: the last ~950 queries attend sparsely
    backend = dense_backend(config, num_slots=4096, max_requests=2, max_context=4096, kv_dtype=torch.bfloat16,
                            device="cuda")
    backend.reserve(0, length + 1)
    prompt = torch.randint(2, config.vocab_size, (length + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    hidden = forward_tokens(model, backend, [0], [0], [prompt[:length]])
    decode = forward_tokens(model, backend, [0], [length], [[prompt[length]]])
    logits = model.compute_logits(torch.cat((hidden[-1:], decode)))
    assert logits.shape == (2, config.vocab_size) and torch.isfinite(logits).all()
