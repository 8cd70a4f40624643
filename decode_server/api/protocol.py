"""OpenAI wire format: request and response bodies of /v1/completions, /v1/chat/completions and /v1/models.

Requests are validated here (ranges, types) so that FastAPI rejects bad input with a clear `param` before any
tokenization; checks that need the model (context length, model name) live in `serving.py`. Unknown fields are
accepted and ignored, as OpenAI-compatible servers do, so that newer clients keep working; fields we do not
implement are declared and rejected with a clear message when set to a non-default value.

Types are strict (`"stream": "yes"` or `"max_tokens": "5"` are 400, not coerced), and every string must be valid
Unicode: JSON allows a lone UTF-16 surrogate (`"\ud800"`), which no tokenizer can encode, so it is refused with
400 naming the parameter.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

MAX_N = 16  # choices per prompt: each choice is a separate engine request
MAX_STOP_SEQUENCES = 16
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 1024  # each entry is edited into the logits at every step of the request


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """Where the first string holding a lone UTF-16 surrogate is in a parsed JSON value (None: nowhere).
    Keys are checked too; a key in the returned path is written with backslash escapes."""
    if isinstance(value, str):
        return path if _has_surrogate(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            key_text = str(key)
            sub = f"{path}.{_printable(key_text)}" if path else _printable(key_text)
            if _has_surrogate(key_text):
                return sub
            found = lone_surrogate_path(item, sub)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = lone_surrogate_path(item, f"{path}.{i}" if path else str(i))
            if found is not None:
                return found
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class _Strict(BaseModel):
    """Strict types, unknown fields ignored, and no lone surrogates anywhere in the body."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = lone_surrogate_path(data)
        if where is not None:
            raise ValueError(f"'{where}' is not valid Unicode (a lone UTF-16 surrogate)")
        return data


class JsonSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`: the schema the output must satisfy (`name`, `description` and
    `strict` are accepted as OpenAI defines them; the schema is always enforced)."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str | None = Field(default=None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema", description="a JSON Schema object")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Strict):

    include_usage: bool = False
    # vLLM's: every chunk carries the usage so far (prompt tokens, tokens generated up to that chunk).
    continuous_usage_stats: bool = False


StopField = Annotated[
    str | list[str] | None,
    Field(default=None, description=f"up to {MAX_STOP_SEQUENCES} strings that end generation (not included)"),
]


class _SamplingFields(_Strict):
    """Parameters shared by both endpoints (OpenAI names plus SGLang's `top_k`, `ignore_eos`, ...)."""

    # SGLang's / vLLM's: False keeps special tokens in the text (chat requests that a tool-call or reasoning
    # parser reads keep them anyway: their markers may be special tokens).
    skip_special_tokens: bool = True

    model: str | None = Field(default=None, description="must be the served model name when given")
    max_tokens: int | None = Field(default=None, ge=1, description="tokens to generate (at least 1)")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="0 means greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, description="-1 or 0 disables top-k filtering")
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: StopField = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, max_length=64)
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N, description=f"choices per prompt, 1..{MAX_N}")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0,
                                    description="subtracted once from the logit of every token in the output")
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0,
                                     description="subtracted per occurrence from the logit of output tokens")
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0,
                                      description="vLLM's / SGLang's: divides positive logits (multiplies negative "
                                      "ones) of tokens in the prompt or output; 1 disables")
    logit_bias: dict[str, float] | None = Field(
        default=None, description=f"token id (as a string) -> bias in [-100, 100] added to its logit; at most "
        f"{MAX_LOGIT_BIAS_ENTRIES} entries",
    )
    min_tokens: int = Field(default=0, ge=0, description="EOS, stop token ids and stop strings wait for this many "
                            "generated tokens (vLLM's / SGLang's)")
    response_format: ResponseFormat | None = Field(
        default=None, description="OpenAI's structured outputs: text, json_object, or json_schema with a schema")
    regex: str | None = Field(default=None, min_length=1, description="SGLang's: the output must match this regex")
    ebnf: str | None = Field(default=None, min_length=1,
                             description="SGLang's: the output must match this EBNF grammar (GBNF-style, rule `root`)")
    user: str | None = None
    priority: int | None = Field(
        default=None, ge=-(2**31), le=2**31 - 1,
        description="SGLang's / vLLM's: with --enable-priority-scheduling, waiting requests are taken in order of "
        "it (larger first unless --schedule-low-priority-values-first), then of arrival",
    )  # fmt: skip
    rid: str | None = Field(
        default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$",
        description="request id (SGLang's name; a router sets it): the response id and the name for "
        "/abort_request; must not be in use; default: a random `cmpl-…`/`chatcmpl-…`",
    )  # fmt: skip
    # PD disaggregation (SGLang's router adds these; a list gives one value per prompt of a batched request).
    bootstrap_host: str | list[str] | None = Field(default=None, description="PD: the prefill server's host")
    bootstrap_port: int | list[int] | None = Field(default=None, description="PD: its bootstrap port")
    bootstrap_room: int | list[int] | None = Field(
        default=None, description="PD: the transfer's id, the same on both servers (0 .. 2^128-1)"
    )
    bootstrap_auth: str | None = Field(
        default=None, max_length=256,
        description="PD: the router's signature of the bootstrap fields (servers with a disaggregation auth "
        "secret require it)",
    )  # fmt: skip


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt`: text, a list of texts, token ids, or a list of token-id lists."""

    prompt: (
        Annotated[str, Field(min_length=1)] | list[str] | list[Annotated[int, Field(ge=0)]]
        | list[list[Annotated[int, Field(ge=0)]]]
    ) = Field(description="text (not empty), texts, token ids, or lists of token ids")
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS, description="top logprobs per token")
    echo: bool = Field(default=False, description="prepend the prompt to each choice's text (not with logprobs: "
                       "that needs the prompt's logprobs, which are not served)")
    best_of: int | None = Field(default=None, ge=1, description="only 1 (or unset) is supported")
    suffix: str | None = Field(default=None, description="not supported")


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Strict):
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


class ToolCallIn(_Strict):
    """A call of an earlier assistant turn, sent back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Strict):
    """`developer` is OpenAI's newer name for `system` and is rendered as a system message. An assistant turn may
    carry `tool_calls`; a `tool` message answers one (`tool_call_id`)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it (transformers' convention): a call's arguments as a dict when
        they are a JSON object (templates iterate over them), else the string as sent."""
        out: dict[str, Any] = {"role": self.template_role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                try:
                    arguments: Any = json.loads(call.function.arguments)
                except ValueError:
                    arguments = call.function.arguments
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": arguments}})
            out["tool_calls"] = calls
        return out

    @property
    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


# Template variables the server passes itself (Tokenizer.apply_chat_template).
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})
MAX_TOOLS = 128


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, description="alias of max_tokens (wins)")
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    # "auto" (the default with tools): the model may call them; "none": it is shown them but its calls are not
    # parsed. "required" and a named function (a constrained call) are refused: not built.
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    # Extra variables for the chat template (SGLang / vLLM), e.g. {"thinking": true} for DeepSeek-V3.1/V3.2.
    chat_template_kwargs: dict[str, Any] | None = None
    # SGLang's: with --reasoning-parser, put the thinking in `reasoning_content` (False: everything in `content`).
    separate_reasoning: bool = True

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_template_names(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(set(kwargs or {}) & RESERVED_TEMPLATE_NAMES)
        if reserved:
            raise ValueError(f"{reserved} are set by the server, not by chat_template_kwargs")
        return kwargs


# ----------------------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # OpenAI's field; present when the server runs with prefix caching (prompt tokens not recomputed).
    prompt_tokens_details: PromptTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _omit_absent_details(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Without prefix caching the usage object stays the three counts (no `"prompt_tokens_details": null`)."""
        data = handler(self)
        if data.get("prompt_tokens_details") is None:
            data.pop("prompt_tokens_details", None)
        return data


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: the answer is tool calls only (OpenAI's null)
    reasoning_content: str | None = None  # --reasoning-parser: the model's thinking (left out when absent)
    tool_calls: list[ToolCallOut] | None = None  # --tool-call-parser (left out when absent)

    @model_serializer(mode="wrap")
    def _drop_absent_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for key in ("reasoning_content", "tool_calls"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str
    arguments: str


class DeltaToolCall(BaseModel):
    """A whole call in one delta (a call is sent once its block has closed)."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    """A streamed piece of the assistant message; absent fields are left out, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "hisparse-decode-server"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class AbortRequestBody(_Strict):
    """POST /abort_request (SGLang's shape): one request id, or every running request."""

    rid: str | None = None
    abort_all: bool = False
