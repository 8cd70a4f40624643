from __future__ import annotations

import pytest
import torch

from decode_server.config import EngineConfig, HiSparseConfig
from decode_server.engine.engine import Engine
from decode_server.model import Tokenizer, load_model, resolve_model_path


@pytest.fixture(scope="session")
def tiny_cpu():
    model, config = load_model("tiny-dsa", "cpu", torch.float32)
    return model, config, Tokenizer.from_dir(resolve_model_path("tiny-dsa"))


@pytest.fixture
def make_engine(tiny_cpu):
    """Engine factory over the shared tiny-dsa model; keyword arguments are EngineConfig fields."""

    def factory(**overrides) -> Engine:
        fields = {"device": "cpu", "page_size": 16, "chunked_prefill_size": 128, "device_kv_budget_bytes": 32 << 20,
                  "hisparse": HiSparseConfig(device_buffer_size=64, num_recent_slots=2)}
        fields.update(overrides)
        model, config, tokenizer = tiny_cpu
        return Engine(EngineConfig(**fields), model=model, model_config=config, tokenizer=tokenizer)

    return factory
