"""The decode engine: scheduler, sampler, KV managers, engine loop and the offline `LLM`.

Heavy members are imported lazily so that `decode_server.engine.types` (used by the API process) does not
pull in torch or the model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "Engine", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from decode_server.engine.llm import LLM

        return LLM
    if name == "Engine":
        from decode_server.engine.engine import Engine

        return Engine
    if name == "SamplingParams":
        from decode_server.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
