"""SGLang's native wire format: the body of POST /generate and its sampling parameters (SGLang's names:
`max_new_tokens`, `min_new_tokens`, `sampling_seed`, `json_schema`, ...), validated like the OpenAI bodies
(protocol.py: strict types, unknown fields ignored, no lone surrogates). Pydantic only: the router imports it.

Ranges are this server's OpenAI ones (temperature 0..2, penalties as in protocol.py), so the same request means the
same thing on both surfaces. Not served, and refused with a 400 naming the field when set: a list of
`sampling_params` (one per prompt), a list of `rid`s, `no_stop_trim: true`, `spaces_between_special_tokens: false`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field, field_validator

from decode_server.api.protocol import MAX_LOGPROBS, MAX_N, StopField, _Strict

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default


class NativeSamplingParams(_Strict):
    """SGLang's `sampling_params` object."""

    max_new_tokens: int | None = Field(default=None, ge=1, description=f"default {DEFAULT_MAX_NEW_TOKENS}")
    min_new_tokens: int = Field(default=0, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="0 means greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, description="-1 or 0 disables top-k filtering")
    sampling_seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: StopField = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, max_length=64)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    regex: str | None = Field(default=None, min_length=1)
    ebnf: str | None = Field(default=None, min_length=1)
    json_schema: str | None = Field(default=None, min_length=1, description="a JSON Schema, as JSON text")


class GenerateRequest(_Strict):
    """POST /generate: `text` (one or a list) or `input_ids` (one list of ids or a list of them)."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={"examples": [
        {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}]})

    text: Annotated[str, Field(min_length=1)] | list[str] | None = None
    input_ids: list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]] | None = None
    sampling_params: NativeSamplingParams | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=MAX_LOGPROBS)
    logprob_start_len: int = Field(default=-1, ge=-1, description="with return_logprob: the prompt's logprobs from "
                                   "this position too (input_token_logprobs); -1: the output's only")
    return_text_in_logprobs: bool = False
    priority: int | None = Field(default=None, ge=-(2**31), le=2**31 - 1)
    rid: str | None = Field(default=None, description="request id (one; a batch's choices are named `<rid>-<i>`)")
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None
    bootstrap_auth: str | None = Field(default=None, max_length=256)

    @field_validator("sampling_params", "rid", mode="before")
    @classmethod
    def _not_per_prompt(cls, value: Any, info: Any) -> Any:
        """SGLang also takes one of these per prompt (a list); this server takes one for the whole request."""
        if isinstance(value, list):
            raise ValueError(f"give one {info.field_name} for the whole request, not a list (one per prompt)")
        return value
