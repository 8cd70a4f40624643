"""Sampling parameters of one request, checked on construction so that bad input never reaches the engine."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# OpenAI's range for a logit_bias value.
MAX_LOGIT_BIAS = 100.0


class StructuredOutput(BaseModel):
    """A constraint on the whole output (engine/structured_output.py): OpenAI's response_format `json_object`
    (any JSON object) or `json_schema` (`spec`: the schema as JSON text), SGLang's `regex` and `ebnf` (`spec`: the
    pattern or the grammar)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["json_object", "json_schema", "regex", "ebnf"]
    spec: str = ""
    # The request field a refusal names when the constraint does not compile (default: by kind), e.g. "tools" for
    # the schema of a forced tool call.
    param: str | None = None


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
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20, description="top logprobs per prompt token "
                                        "(engine/prompt_logprobs.py; the prompt is then computed whole, no cache)")
    # Logits processing (engine/logits_processor.py), applied before temperature, top-k and top-p; logprobs stay
    # those of the model's own distribution.
    min_tokens: int = Field(default=0, ge=0, description="EOS, stop token ids and stop strings wait for this many")
    logit_bias: dict[int, float] = Field(default_factory=dict, description="token id -> added to its logit")
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0, description="1 disables (prompt + output)")
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="times the output's count")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="once a token is in the output")
    structured: StructuredOutput | None = Field(default=None, description="a grammar the output must match")
    # False: special tokens are part of the text (a tool-call or reasoning parser reads markers that some
    # tokenizers hold as special tokens, e.g. GLM's <tool_call>).
    skip_special_tokens: bool = True
    # Not sampling but scheduling, carried here so that it reaches the engine on every path (api, PD, DP, LLM):
    # with --enable-priority-scheduling the waiting queue is ordered by it (engine/scheduler.py).
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)

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

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[int, float]) -> dict[int, float]:
        for token, bias in v.items():
            if token < 0:
                raise ValueError(f"logit_bias token ids must be non-negative (got {token})")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] (got {bias})")
        return v

    @model_validator(mode="after")
    def _check_min_tokens(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.min_tokens and self.structured is not None:
            # A finished grammar allows only EOS, which min_tokens would forbid: no token would be left.
            raise ValueError("min_tokens cannot be combined with a structured output constraint")
        return self

    @property
    def uses_token_counts(self) -> bool:
        """Whether sampling needs the counts of the tokens generated so far (and of the prompt's, for repetition)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
