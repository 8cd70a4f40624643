"""Configuration objects, one per concern, built from CLI flags (names follow SGLang where one exists)."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class HiSparseConfig(BaseModel):
    """`--hisparse-config` JSON. Keys as in SGLang (`top_k`, `device_buffer_size`, `host_to_device_ratio`)
    plus ours."""

    model_config = ConfigDict(extra="forbid")

    top_k: int | None = Field(default=None, ge=1, description="tokens attended per step; default: index_topk")
    device_buffer_size: int | None = Field(
        default=None, ge=1, description="LRU device slots per request (D); default 2 * top_k; must be >= top_k"
    )
    host_to_device_ratio: float = Field(
        default=4.0, gt=0, description="host KV pool size relative to the device KV budget (when not explicit)"
    )
    num_recent_slots: int = Field(
        default=4, ge=1, description="device slots per request that keep its newest tokens (always hits)"
    )

    @classmethod
    def from_json(cls, text: str | None) -> HiSparseConfig:
        if not text:
            return cls()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--hisparse-config is not valid JSON: {exc}") from exc
        return cls.model_validate(data)


KVCacheDType = Literal["auto", "bfloat16", "float16", "float32", "fp8_e4m3"]


class EngineConfig(BaseModel):
    """Everything the engine process needs: model, device, memory budgets, scheduling limits."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = "tiny-dsa"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    kv_cache_dtype: KVCacheDType = "auto"
    # "torch_native": the PyTorch reference attention / indexer kernels even on CUDA (any MLA / indexer size).
    attention_backend: Literal["auto", "torch_native"] = "auto"
    # Batch-invariant mode: a request's tokens and logprobs do not depend on what else runs (docs/models.md).
    enable_deterministic_inference: bool = False
    seed: int = 0

    enable_hisparse: bool = False
    hisparse: HiSparseConfig = Field(default_factory=HiSparseConfig)

    # Memory sizing. Explicit budgets win over the fraction.
    mem_fraction_static: float = Field(default=0.85, gt=0, le=1.0)
    device_kv_budget_bytes: int | None = Field(default=None, ge=0)
    host_kv_budget_bytes: int | None = Field(default=None, ge=0)
    page_size: int = Field(default=64, ge=1)

    # Scheduling.
    max_running_requests: int = Field(default=64, ge=1)
    max_queued_requests: int = Field(default=1024, ge=1)
    chunked_prefill_size: int = Field(default=2048, ge=1)
    context_length: int | None = Field(default=None, ge=1)

    @field_validator("model_path")
    @classmethod
    def _non_empty(cls, v: str) -> str:
        if not v:
            raise ValueError("model_path must not be empty")
        return v

    @model_validator(mode="after")
    def _check_hisparse(self) -> EngineConfig:
        hs = self.hisparse
        if hs.top_k is not None and hs.device_buffer_size is not None and hs.device_buffer_size < hs.top_k:
            raise ValueError(
                f"hisparse device_buffer_size ({hs.device_buffer_size}) must be >= top_k ({hs.top_k})"
            )
        return self


class ServerConfig(BaseModel):
    """The HTTP surface."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=30000, ge=0, le=65535)
    api_key: str | None = None
    served_model_name: str | None = None
    log_level: str = "info"
