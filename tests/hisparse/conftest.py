from __future__ import annotations

import dataclasses

import pytest
import torch

from decode_server.model import Tokenizer, build_random_model, load_config, load_model, resolve_model_path


@pytest.fixture(scope="session")
def tiny_cpu():
    model, config = load_model("tiny-dsa", "cpu", torch.float32)
    return model, config, Tokenizer.from_dir(resolve_model_path("tiny-dsa"))


@pytest.fixture(scope="session")
def tiny_cuda():
    """tiny-dsa in bf16 on the GPU (the GPU lossless tests); skips where there is no CUDA. Dequantized on purpose
    (the default on CUDA keeps its FP8 weights): the FP8-weight runs are test_fp8_weights_lossless_gpu.py."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, config = load_model("tiny-dsa", "cuda", torch.bfloat16, quantization="none")
    return model, config, Tokenizer.from_dir(resolve_model_path("tiny-dsa"))


@pytest.fixture(scope="session")
def wide_cuda():
    """tiny-dsa with 64 heads and top-k 128 (shapes FlashMLA takes), random bf16 weights on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    config = dataclasses.replace(load_config("tiny-dsa"), num_attention_heads=64, num_key_value_heads=64,
                                 index_topk=128)
    model = build_random_model(config, "cuda", torch.bfloat16, seed=3)
    return model, config, Tokenizer.from_dir(resolve_model_path("tiny-dsa"))
