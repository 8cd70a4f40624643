from __future__ import annotations

import os

import pytest
import torch

from decode_server.model import Tokenizer, load_model, resolve_model_path

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def tiny_cpu():
    model, config = load_model("tiny-dsa", "cpu", torch.float32)
    return model, config, Tokenizer.from_dir(resolve_model_path("tiny-dsa"))
