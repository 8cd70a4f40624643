from __future__ import annotations

import pytest
import torch

from decode_server.model import Tokenizer, load_model, resolve_model_path


@pytest.fixture(scope="session")
def tiny_cpu():
    model, config = load_model("tiny-dsa", "cpu", torch.float32)
    return model, config, Tokenizer.from_dir(resolve_model_path("tiny-dsa"))


@pytest.fixture(scope="session")
def tiny_cuda():
    """tiny-dsa in bf16 on the GPU (the GPU lossless tests); skips where there is no CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, config = load_model("tiny-dsa", "cuda", torch.bfloat16)
    return model, config, Tokenizer.from_dir(resolve_model_path("tiny-dsa"))
