"""Sampling parameters of one request, checked on construction so that bad input never reaches the engine."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    """How to pick tokens and when to stop. `temperature == 0` means greedy."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, description="-1 or 0 disables top-k filtering")
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20, description="top logprobs per generated token")

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError("top_k must be -1 (disabled), 0 (disabled) or positive")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: object) -> object:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        return v

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
