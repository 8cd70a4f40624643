"""/v1/completions and /v1/chat/completions: validate, tokenize, submit, then stream (SSE) or collect.

The checks that need the model live here: served model name, prompt length against the context length,
token ids against the vocabulary, and parameters we do not implement (rejected with 400 and the parameter's
name rather than silently ignored). Text comes from the engine's incremental detokenizer (stop strings
already cut off), so the offline `LLM` and the server return identical text for identical tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from decode_server.api.chat_output import ChatOutputParser
from decode_server.api.engine_client import EngineClient
from decode_server.api.errors import error_body
from decode_server.api.forced_tool_calls import ForcedToolChoice, forced_tool_choice
from decode_server.api.generation import ChoiceSpec, ChoiceState, GenerationGroup
from decode_server.api.metrics import ServerMetrics
from decode_server.api.protocol import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_SEQUENCES,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    PromptTokensDetails,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
    random_id,
)
from decode_server.api.reasoning import REASONING_PARSERS, ReasoningFormat
from decode_server.api.request_log import RequestLog
from decode_server.api.sse import DONE_FRAME, SSE_HEADERS, sse_frame
from decode_server.api.tokenization import TokenizerPool, chat_chars
from decode_server.api.tool_calls import TOOL_CALL_PARSERS, ToolCallFormat
from decode_server.disagg.bootstrap_info import MAX_ROOM, BootstrapInfo
from decode_server.engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams, StructuredOutput
from decode_server.engine.types import TokenLogprob
from decode_server.errors import (
    CapacityError,
    ContextLengthExceededError,
    DecodeServerError,
    InvalidRequestError,
    PDAuthenticationError,
)
from transfer.auth import AuthRejected, RejectionLog

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_ROUTES = {"cmpl": "/v1/completions", "chatcmpl": "/v1/chat/completions", "gen": "/generate"}  # by id prefix
DISCONNECT_POLL_S = 0.25
MIN_TEMPERATURE = 1e-5  # below: greedy (as vLLM does)
MIN_TOP_P = 1e-6


@dataclass
class ModelInfo:
    """What the handlers need to know about the served model."""

    served_model_name: str
    context_length: int
    vocab_size: int
    accepted_names: frozenset[str]
    disaggregation_mode: str = "null"  # "prefill" / "decode": requests must carry bootstrap fields
    # transfer.auth.PDAuth with a cluster secret: PD requests must carry the router's ticket (`bootstrap_auth`)
    pd_auth: Any = None
    # The most tokens (prompt + max_tokens - 1) the KV cache can hold for one request (≤ context length).
    max_request_tokens: int = 0
    prefix_caching: bool = False  # usage reports `prompt_tokens_details.cached_tokens`
    reasoning_parser: str | None = None  # --reasoning-parser (decode_server/api/reasoning.py)
    tool_call_parser: str | None = None  # --tool-call-parser (decode_server/api/tool_calls.py)


class OpenAIServing:
    def __init__(
        self, client: EngineClient, tokenizer: Any, metrics: ServerMetrics, model: ModelInfo,
        tokenizer_pool: TokenizerPool | None = None, request_log: RequestLog | None = None,
    ) -> None:
        self.client = client
        self.request_log = request_log  # --log-requests
        self.tokenizer = tokenizer
        self.tokenizer_pool = tokenizer_pool
        self.metrics = metrics
        self.model = model
        self.groups: dict[str, GenerationGroup] = {}  # running HTTP requests by id, for /abort_request
        self._pd_rejections = RejectionLog("PD request")

    def abort(self, request_id: str, reason: str) -> int:
        """Abort a running completion by its response id (`cmpl-…`, `chatcmpl-…`) or one engine rid."""
        group = self.groups.get(request_id)
        if group is not None:
            return group.abort_unfinished(reason)
        return int(self.client.abort_nowait(request_id, reason))

    def _new_group(self, prefix: str, specs: list[ChoiceSpec], rid: str | None = None) -> GenerationGroup:
        if rid is not None and rid in self.groups:
            raise InvalidRequestError(f"request id '{rid}' is already in use", param="rid")
        group = GenerationGroup(self.client, self.metrics, rid or random_id(prefix), specs)
        self.groups[group.request_id] = group
        log = self.request_log

        def done() -> None:
            self.groups.pop(group.request_id, None)
            if log is not None:
                log.finished(group)

        group.on_done = done
        if log is not None:
            log.received(group, _ROUTES.get(prefix, prefix))
        return group

    # -------------------------------------------------------------------------------------- validation

    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model.accepted_names:
            raise InvalidRequestError(
                f"model '{name}' is not served here; this server serves '{self.model.served_model_name}'",
                param="model",
            )

    @staticmethod
    def _check_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
        def reject(param: str, what: str) -> None:
            raise InvalidRequestError(f"'{param}' is not supported by this server ({what})", param=param)

        if isinstance(req, CompletionRequest):
            if req.best_of not in (None, 1):
                reject("best_of", "use n for several choices")
            if req.suffix:
                reject("suffix", "leave it unset")
        else:
            if req.top_logprobs is not None and not req.logprobs:
                raise InvalidRequestError("'top_logprobs' requires 'logprobs': true", param="top_logprobs")

    @staticmethod
    def _stop_list(stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise InvalidRequestError(
                f"at most {MAX_STOP_SEQUENCES} stop sequences are accepted", param="stop"
            )
        if any(s == "" for s in stops):
            raise InvalidRequestError("stop sequences must not be empty strings", param="stop")
        return stops

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float]:
        """OpenAI's `logit_bias` (token ids as JSON object keys) → {token id: bias}, every id in the vocabulary."""
        if not bias:
            return {}
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError(f"'logit_bias' has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are "
                                      "accepted", param="logit_bias")
        out: dict[int, float] = {}
        for key, value in bias.items():
            token = int(key) if len(key) <= 10 and key.isdecimal() else -1
            if not 0 <= token < self.model.vocab_size:
                raise InvalidRequestError(f"'logit_bias' keys must be token ids in [0, {self.model.vocab_size}) "
                                          f"(got {key!r})", param="logit_bias")
            if token in out:
                raise InvalidRequestError(f"'logit_bias' names token {token} twice", param="logit_bias")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise InvalidRequestError(f"'logit_bias' values must be in [-{MAX_LOGIT_BIAS:g}, "
                                          f"{MAX_LOGIT_BIAS:g}] (got {value} for {key!r})", param="logit_bias")
            out[token] = value
        return out

    @staticmethod
    def _structured(req: CompletionRequest | ChatCompletionRequest) -> StructuredOutput | None:
        """response_format (OpenAI), regex or ebnf (SGLang's) → the engine's constraint; at most one of them."""
        fmt = req.response_format if req.response_format is not None and req.response_format.type != "text" else None
        given = [name for name, v in (("response_format", fmt), ("regex", req.regex), ("ebnf", req.ebnf)) if v]
        if len(given) > 1:
            raise InvalidRequestError(f"give one output constraint, not {' and '.join(given)}", param=given[1])
        if req.regex is not None:
            return StructuredOutput(kind="regex", spec=req.regex)
        if req.ebnf is not None:
            return StructuredOutput(kind="ebnf", spec=req.ebnf)
        if fmt is None:
            return None
        if fmt.type == "json_object":
            return StructuredOutput(kind="json_object")
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidRequestError("response_format of type json_schema needs json_schema.schema",
                                      param="response_format.json_schema")
        return StructuredOutput(kind="json_schema", spec=json.dumps(fmt.json_schema.schema_))

    def _check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty (no tokens)", param=param)
        if len(ids) >= self.model.context_length:
            raise self._too_long(len(ids), param)
        bad = next((t for t in ids if t < 0 or t >= self.model.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad} is outside the vocabulary (size {self.model.vocab_size})", param=param
            )

    def _max_tokens(self, requested: int | None, prompt_len: int, default: int | None) -> int:
        """The request's max_tokens. Left out, it is `default`, or (chat) "until EOS or the end of the context";
        either way no more than the whole KV cache can hold for this prompt (as SGLang clamps it). Given, it must
        fit the context length (400 otherwise; the engine refuses one the cache could never hold)."""
        room = self.model.context_length - prompt_len
        if requested is None:
            cache_room = (self.model.max_request_tokens or self.model.context_length) + 1 - prompt_len
            if cache_room < 1:
                raise CapacityError(
                    f"the prompt has {prompt_len} tokens; the KV cache holds at most "
                    f"{self.model.max_request_tokens} tokens for one request", param="messages",
                )
            room = min(room, cache_room)
            return room if default is None else min(default, room)
        if prompt_len + requested > self.model.context_length:
            raise ContextLengthExceededError(
                f"prompt ({prompt_len} tokens) + max_tokens ({requested}) = {prompt_len + requested} tokens is "
                f"beyond the context length ({self.model.context_length}); ask for at most {room} tokens",
                param="max_tokens",
            )
        return requested

    def _sampling_params(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        max_tokens: int,
        logprobs: int | None,
        choice: int,
        keep_special_tokens: bool = False,
        structured: StructuredOutput | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        # With an explicit seed, choice i samples with seed + i: n identical choices would be pointless.
        seed = None if req.seed is None else (req.seed + choice) % 2**63
        # Temperatures this close to 0 overflow float32 logits (inf/NaN probabilities): they mean greedy. A top_p
        # below float32's reach would round to 0 and drop every token; any value that small keeps only the top one.
        temperature = 0.0 if req.temperature < MIN_TEMPERATURE else req.temperature
        top_p = max(req.top_p, MIN_TOP_P)
        if req.min_tokens > max_tokens:
            raise InvalidRequestError(f"'min_tokens' ({req.min_tokens}) is more than max_tokens ({max_tokens})",
                                      param="min_tokens")
        structured = structured or self._structured(req)  # `structured`: the server's own (a forced tool call)
        if structured is not None and req.min_tokens:
            raise InvalidRequestError("'min_tokens' cannot be combined with an output constraint (a finished "
                                      "grammar allows only EOS)", param="min_tokens")
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=req.top_k,
                seed=seed,
                stop=self._stop_list(req.stop),
                stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                min_tokens=req.min_tokens,
                logit_bias=self._logit_bias(req.logit_bias),
                repetition_penalty=req.repetition_penalty,
                frequency_penalty=req.frequency_penalty,
                presence_penalty=req.presence_penalty,
                structured=structured,
                skip_special_tokens=req.skip_special_tokens and not keep_special_tokens,
                priority=req.priority or 0,
                prompt_logprobs=prompt_logprobs,
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first.get("loc", ())) or None
            raise InvalidRequestError(
                f"invalid value for '{param}': {first.get('msg')}", param=param
            ) from exc

    def _bootstrap(self, req: CompletionRequest | ChatCompletionRequest, num_prompts: int) -> list[BootstrapInfo | None]:
        """PD modes: one `BootstrapInfo` per prompt from `bootstrap_host/port/room` (scalars, or lists with one
        value per prompt as SGLang's router sends for batched prompts). Colocated mode ignores the fields."""
        mode = self.model.disaggregation_mode
        if mode == "null":
            return [None] * num_prompts
        fields = {"bootstrap_host": req.bootstrap_host, "bootstrap_port": req.bootstrap_port,
                  "bootstrap_room": req.bootstrap_room}
        missing = [name for name, value in fields.items() if value is None]
        if missing:
            raise InvalidRequestError(
                f"this server runs with --disaggregation-mode {mode}: the request needs 'bootstrap_host', "
                f"'bootstrap_port' and 'bootstrap_room' (a PD router adds them); missing {missing}",
                param=missing[0],
            )
        if req.n != 1:
            raise InvalidRequestError(
                "n > 1 is not supported with prefill/decode disaggregation (each choice would need its own "
                "bootstrap_room); send n separate requests", param="n",
            )
        per_prompt: dict[str, list] = {}
        for name, value in fields.items():
            values = value if isinstance(value, list) else [value] * num_prompts
            if len(values) != num_prompts:
                raise InvalidRequestError(
                    f"'{name}' has {len(values)} values for {num_prompts} prompt(s): give one per prompt",
                    param=name,
                )
            per_prompt[name] = values
        rooms = per_prompt["bootstrap_room"]
        if self.model.pd_auth is not None:
            self._check_ticket(req)
        if any(not 0 <= r <= MAX_ROOM for r in rooms):
            raise InvalidRequestError(f"'bootstrap_room' must be in [0, {MAX_ROOM}]", param="bootstrap_room")
        if len(set(rooms)) != len(rooms):
            raise InvalidRequestError("each prompt needs its own 'bootstrap_room' (give a list)",
                                      param="bootstrap_room")
        if any(not 0 < p < 65536 for p in per_prompt["bootstrap_port"]):
            raise InvalidRequestError("'bootstrap_port' must be a TCP port (1..65535)", param="bootstrap_port")
        if any(not h for h in per_prompt["bootstrap_host"]):
            raise InvalidRequestError("'bootstrap_host' must not be empty", param="bootstrap_host")
        return [BootstrapInfo(h, p, r) for h, p, r in zip(per_prompt["bootstrap_host"], per_prompt["bootstrap_port"],
                                                          rooms, strict=True)]

    def _check_ticket(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        """With a cluster secret, the bootstrap fields must be the ones an authenticated router issued: nobody else
        can name a room (and so have a prompt's KV sent to a decode server it chose)."""
        try:
            self.model.pd_auth.verify_ticket(req.bootstrap_auth, req.bootstrap_host, req.bootstrap_port,
                                             req.bootstrap_room)
        except AuthRejected as exc:
            self._pd_rejections(exc.reason, exc.detail, req.rid or "")
            raise PDAuthenticationError(
                f"PD request refused: {exc.detail}; this server accepts only requests from a PD router holding the "
                "deployment's --disaggregation-auth-secret-file") from None

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -------------------------------------------------------------------------------------- completions

    def _check_num_choices(self, num_choices: int, param: str) -> None:
        """Every choice is an engine request: more than the engine's waiting queue holds could never be accepted
        together, so that is a 400 (a 503 would invite a retry that can never succeed)."""
        limit = self.client.engine_config.max_queued_requests
        if num_choices > limit:
            raise InvalidRequestError(
                f"this request asks for {num_choices} completions (prompts × n); the server accepts at most "
                f"{limit} at once", param=param,
            )

    def _check_text_length(self, num_chars: int, param: str) -> None:
        """Refuse a text that surely has more tokens than the context holds, before tokenizing it."""
        pool = self.tokenizer_pool
        if pool is not None and pool.lower_bound_tokens(num_chars) >= self.model.context_length:
            raise ContextLengthExceededError(
                f"the prompt has {num_chars} characters, so at least {pool.lower_bound_tokens(num_chars)} tokens; "
                f"the context length is {self.model.context_length} tokens", param=param,
            )

    def _too_long(self, num_tokens: int, param: str) -> ContextLengthExceededError:
        return ContextLengthExceededError(
            f"the prompt has {num_tokens} tokens; the context length is {self.model.context_length} "
            "(it must leave room for at least one generated token)", param=param,
        )

    async def _encode(self, text: str) -> list[int]:
        if self.tokenizer_pool is None:
            return self.tokenizer.encode(text)
        ids = await self.tokenizer_pool.encode(text, limit=self.model.context_length)
        if isinstance(ids, int):
            raise self._too_long(ids, "prompt")
        return ids

    async def _completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        prompt = req.prompt
        if isinstance(prompt, str):
            texts_or_ids: list[Any] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            texts_or_ids = [list(prompt)]
        else:
            texts_or_ids = list(prompt)
        if not texts_or_ids:
            raise InvalidRequestError("the prompt list is empty", param="prompt")
        self._check_num_choices(len(texts_or_ids) * req.n, "prompt")
        for item in texts_or_ids:
            if isinstance(item, str):
                if not item:
                    raise InvalidRequestError("the prompt is empty (an empty string)", param="prompt")
                self._check_text_length(len(item), "prompt")
        out = []
        for item in texts_or_ids:
            ids = await self._encode(item) if isinstance(item, str) else list(item)
            self._check_prompt(ids, "prompt")
            out.append(ids)
        return out

    async def completions(self, req: CompletionRequest, raw: Request) -> Any:
        self._check_model(req.model)
        self._check_unsupported(req)
        prompts = await self._completion_prompts(req)
        bootstraps = self._bootstrap(req, len(prompts))
        specs = []
        for p_index, ids in enumerate(prompts):
            max_tokens = self._max_tokens(req.max_tokens, len(ids), DEFAULT_COMPLETION_MAX_TOKENS)
            for k in range(req.n):
                index = p_index * req.n + k
                # echo + logprobs: the prompt's logprobs too (as vLLM answers it)
                params = self._sampling_params(req, max_tokens, req.logprobs, k,
                                               prompt_logprobs=req.logprobs if req.echo else None)
                specs.append(
                    ChoiceSpec(index=index, prompt_token_ids=ids, params=params, prompt_index=p_index,
                               bootstrap=bootstraps[p_index])
                )
        group = self._new_group("cmpl", specs, req.rid)
        echoed = self._echoed_prompts(req, prompts) if req.echo else [""] * len(prompts)
        want_logprobs = req.logprobs is not None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

        echo_pending = {c.spec.index for c in group.choices} if req.echo else set()

        def choice_logprobs(choice: ChoiceState, logprobs: list[TokenLogprob], echo: bool) -> CompletionLogprobs:
            """The output's logprobs, after the prompt's when the prompt is echoed (its first token has none)."""
            if not echo:
                return self._completion_logprobs(logprobs, 0)
            ids = choice.spec.prompt_token_ids
            known = choice.prompt_logprobs or [None] * len(ids)  # none yet: the choice ended before its first token
            prompt = self._completion_logprobs(
                [TokenLogprob(token_id=t, logprob=0.0) if lp is None else lp for t, lp in zip(ids, known, strict=True)],
                0)  # fmt: skip
            for i, lp in enumerate(known):
                if lp is None:  # the first prompt token has no logprob
                    prompt.token_logprobs[i], prompt.top_logprobs[i] = None, None
            offset = sum(len(t) for t in prompt.tokens)
            out = self._completion_logprobs(logprobs, offset)
            return CompletionLogprobs(tokens=prompt.tokens + out.tokens,
                                      token_logprobs=prompt.token_logprobs + out.token_logprobs,
                                      top_logprobs=prompt.top_logprobs + out.top_logprobs,
                                      text_offset=prompt.text_offset + out.text_offset)

        def chunk(
            choice: ChoiceState, text: str, logprobs: list[TokenLogprob], finish: str | None
        ) -> BaseModel:
            echo = choice.spec.index in echo_pending  # the prompt comes first, with the choice's first chunk
            echo_pending.discard(choice.spec.index)
            return CompletionResponse(
                id=group.request_id,
                model=self.model.served_model_name,
                choices=[
                    CompletionChoice(
                        index=choice.spec.index,
                        text=echoed[choice.spec.prompt_index] + text if echo else text,
                        logprobs=choice_logprobs(choice, logprobs, echo) if want_logprobs else None,
                        finish_reason=finish,
                    )
                ],
                usage=self._usage(group) if continuous else None,
            )

        def usage_chunk(usage: UsageInfo) -> BaseModel:
            return CompletionResponse(
                id=group.request_id, model=self.model.served_model_name, choices=[], usage=usage
            )

        def final(usage: UsageInfo) -> BaseModel:
            return CompletionResponse(
                id=group.request_id,
                model=self.model.served_model_name,
                choices=[
                    CompletionChoice(
                        index=c.spec.index,
                        text=echoed[c.spec.prompt_index] + c.text,
                        logprobs=choice_logprobs(c, c.logprobs, req.echo) if want_logprobs else None,
                        finish_reason=c.finish_reason,
                    )
                    for c in group.choices
                ],
                usage=usage,
            )

        try:
            await group.submit()
        except DecodeServerError as exc:
            if exc.param == "prompt_logprobs":  # the engine's name for what echo + logprobs asks
                exc.param = "echo"
            raise
        if req.stream:
            return self._stream(group, raw, None, chunk, usage_chunk if include_usage else None)
        return await self._collect(group, raw, final)

    def _echoed_prompts(self, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """`echo`: each prompt as the client wrote it (a token-id prompt: its text)."""
        given = [req.prompt] if isinstance(req.prompt, str) else list(req.prompt)
        if len(given) != len(prompts) or not all(isinstance(p, str) for p in given):
            return [self.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]
        return [str(p) for p in given]

    def _completion_logprobs(self, logprobs: list[TokenLogprob], offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for lp in logprobs:
            token = self._token_text(lp.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({self._token_text(t): v for t, v in lp.top_logprobs} or None)
            out.text_offset.append(offset)
            offset += len(token)
        return out

    # -------------------------------------------------------------------------------------- chat

    def _tool_choice(self, req: ChatCompletionRequest) -> tuple[ToolCallFormat | None, ForcedToolChoice | None]:
        """How this request's tool calls are read: the `--tool-call-parser` format ("auto"), a constrained call
        ("required" or a named function: no parser needed) or neither (no tools, or "none"); 400s for what is
        not served."""
        if req.tool_choice is not None and not req.tools:
            raise InvalidRequestError("'tool_choice' needs 'tools'", param="tool_choice")
        if not req.tools:
            return None, None
        names = [t.function.name for t in req.tools]
        if len(set(names)) != len(names):
            raise InvalidRequestError("two tools have the same function name", param="tools")
        choice = req.tool_choice or "auto"
        forced = forced_tool_choice(choice, [t.model_dump(exclude_none=True) for t in req.tools],
                                    req.parallel_tool_calls)  # fmt: skip
        if forced is not None:
            if self._structured(req) is not None:
                raise InvalidRequestError("'tool_choice' \"required\" or a named function constrains the output "
                                          "itself: it cannot be combined with response_format, regex or ebnf",
                                          param="tool_choice")
            return None, forced
        if choice == "none":
            return None, None
        if self.model.tool_call_parser is None:
            raise InvalidRequestError("this server parses no tool calls: start it with --tool-call-parser "
                                      "(deepseekv32, glm), or force a call with tool_choice \"required\" or a "
                                      "named function", param="tools")
        return TOOL_CALL_PARSERS[self.model.tool_call_parser], None

    async def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        messages = [m.template_dict() for m in req.messages]
        template_kwargs = dict(req.chat_template_kwargs or {})
        if req.tools:  # transformers' convention: the template renders them (`tools`)
            template_kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
        self._check_text_length(chat_chars(messages, template_kwargs), "messages")
        try:
            if self.tokenizer_pool is not None:
                ids = await self.tokenizer_pool.encode_chat(messages, req.add_generation_prompt,
                                                            limit=self.model.context_length,
                                                            template_kwargs=template_kwargs)
                if isinstance(ids, int):
                    raise self._too_long(ids, "messages")
            else:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                          **template_kwargs)
                ids = self.tokenizer.encode(text, add_special_tokens=False)
        except DecodeServerError:
            raise
        except Exception as exc:  # the template raises (raise_exception) on conversations it cannot render
            raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from exc
        self._check_prompt(ids, "messages")
        return ids

    def _reasoning_format(self, req: ChatCompletionRequest, forced: ForcedToolChoice | None) -> ReasoningFormat | None:
        """The reasoning parser for this request (None: the whole output is `content`)."""
        if self.model.reasoning_parser is None or not req.separate_reasoning:
            return None
        fmt = REASONING_PARSERS[self.model.reasoning_parser]
        if fmt.starts_in_reasoning(req.chat_template_kwargs) and (forced or self._structured(req)) is not None:
            raise InvalidRequestError(
                "a constrained output (response_format / regex / ebnf, or tool_choice \"required\" / a named "
                "function) cannot follow a reasoning that the prompt opens: the constraint would apply to the "
                "thinking; turn thinking off or set separate_reasoning false",
                param="tool_choice" if forced is not None else "response_format")
        return fmt

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Any:
        self._check_model(req.model)
        self._check_unsupported(req)
        tool_format, forced = self._tool_choice(req)
        reasoning = self._reasoning_format(req, forced)
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        ids = await self._chat_prompt(req)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self._max_tokens(requested, len(ids), None)
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        bootstrap = self._bootstrap(req, 1)[0]
        parsed = reasoning is not None or tool_format is not None  # their markers may be special tokens
        structured = None
        if forced is not None:
            structured = StructuredOutput(kind="json_schema", spec=json.dumps(forced.schema), param="tools")
        specs = [
            ChoiceSpec(
                index=k, prompt_token_ids=ids, bootstrap=bootstrap,
                params=self._sampling_params(req, max_tokens, num_logprobs, k, keep_special_tokens=parsed,
                                             structured=structured),
            )
            for k in range(req.n)
        ]
        group = self._new_group("chatcmpl", specs, req.rid)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        model_name = self.model.served_model_name
        def output_parser() -> ChatOutputParser:
            return ChatOutputParser(reasoning, req.chat_template_kwargs, tool_format, tools,
                                    max_calls=1 if req.parallel_tool_calls is False else None, forced=forced)

        parsers = {c.spec.index: output_parser() for c in group.choices}

        def delta_message(choice: ChoiceState, text: str, finish: str | None) -> DeltaMessage:
            parser = parsers[choice.spec.index]
            if not parser.active:
                return DeltaMessage(content=text if text or finish is None else None)
            first_call = parser.num_calls
            thought, answer, calls = parser.feed(text)
            if finish is not None:
                more_thought, more_answer, more_calls = parser.finish()
                thought, answer, calls = thought + more_thought, answer + more_answer, calls + more_calls
            deltas = [DeltaToolCall(index=first_call + i, id=c.id,
                                    function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                      for i, c in enumerate(calls)]
            return DeltaMessage(content=answer or None, reasoning_content=thought or None, tool_calls=deltas or None)

        def chunk(
            choice: ChoiceState, text: str, logprobs: list[TokenLogprob], finish: str | None
        ) -> BaseModel:
            delta = delta_message(choice, text, finish)  # first: it counts the calls the finish reason needs
            return ChatCompletionChunk(
                id=group.request_id,
                model=model_name,
                choices=[
                    ChatStreamChoice(
                        index=choice.spec.index,
                        delta=delta,
                        logprobs=self._chat_logprobs(logprobs) if req.logprobs and logprobs else None,
                        finish_reason=parsers[choice.spec.index].finish_reason(finish),
                    )
                ],
                usage=self._usage(group) if continuous else None,
            )

        def first(choice: ChoiceState) -> BaseModel:
            return ChatCompletionChunk(
                id=group.request_id,
                model=model_name,
                choices=[
                    ChatStreamChoice(
                        index=choice.spec.index, delta=DeltaMessage(role="assistant", content="")
                    )
                ],
                usage=self._usage(group) if continuous else None,
            )

        def usage_chunk(usage: UsageInfo) -> BaseModel:
            return ChatCompletionChunk(id=group.request_id, model=model_name, choices=[], usage=usage)

        def choice_of(c: ChoiceState) -> ChatChoice:
            parser = output_parser()
            thought, answer, calls = parser.whole(c.text)
            message = ChatResponseMessage(
                content=answer, reasoning_content=thought,
                tool_calls=[ToolCallOut(id=t.id, function=FunctionCallOut(name=t.name, arguments=t.arguments))
                            for t in calls] or None)
            return ChatChoice(index=c.spec.index, message=message,
                              logprobs=self._chat_logprobs(c.logprobs) if req.logprobs else None,
                              finish_reason=parser.finish_reason(c.finish_reason))

        def final(usage: UsageInfo) -> BaseModel:
            return ChatCompletionResponse(id=group.request_id, model=model_name,
                                          choices=[choice_of(c) for c in group.choices], usage=usage)

        await group.submit()
        if req.stream:
            return self._stream(group, raw, first, chunk, usage_chunk if include_usage else None)
        return await self._collect(group, raw, final)

    def _chat_logprobs(self, logprobs: list[TokenLogprob]) -> ChatLogprobs:
        content = []
        for lp in logprobs:
            token = self._token_text(lp.token_id)
            content.append(
                ChatTokenLogprob(
                    token=token,
                    logprob=lp.logprob,
                    bytes=list(token.encode()),
                    top_logprobs=[
                        TopLogprob(token=(t := self._token_text(tid)), logprob=v, bytes=list(t.encode()))
                        for tid, v in lp.top_logprobs
                    ],
                )
            )
        return ChatLogprobs(content=content)

    # -------------------------------------------------------------------------------------- delivery

    def _usage(self, group: GenerationGroup) -> UsageInfo:
        prompt, completion = group.prompt_tokens, group.completion_tokens
        details = PromptTokensDetails(cached_tokens=group.cached_tokens) if self.model.prefix_caching else None
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details=details)

    async def _collect(
        self, group: GenerationGroup, raw: Request, final: Callable[[UsageInfo], BaseModel | dict | list]
    ) -> JSONResponse:
        """Wait for every choice; abort them all if the client goes away first."""

        async def drain() -> None:
            async for _ in group.events():
                pass

        task = asyncio.create_task(drain())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if not task.done() and await raw.is_disconnected():
                    logger.info("client of %s disconnected; aborting", group.request_id)
                    group.abort_unfinished("client disconnected")
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    return JSONResponse(error_body("client disconnected", "aborted", 499), status_code=499)
            task.result()
        finally:
            if not task.done():
                task.cancel()
            group.abort_unfinished("request handler ended")
        body = final(self._usage(group))
        return JSONResponse(body.model_dump(mode="json") if isinstance(body, BaseModel) else body)

    def _stream(
        self,
        group: GenerationGroup,
        raw: Request,
        first: Callable[[ChoiceState], BaseModel] | None,
        chunk: Callable[[ChoiceState, str, list[TokenLogprob], str | None], BaseModel | dict],
        usage_chunk: Callable[[UsageInfo], BaseModel] | None,
    ) -> StreamingResponse:
        async def frames() -> AsyncIterator[str]:
            try:
                if first is not None:
                    for choice in group.choices:
                        yield sse_frame(first(choice))
                async for choice, event in group.events():
                    delta = event.delta
                    assert delta is not None
                    finish = choice.finish_reason if delta.finished else None
                    if delta.text or delta.logprobs or finish is not None:
                        yield sse_frame(chunk(choice, delta.text, list(delta.logprobs or []), finish))
                if usage_chunk is not None:
                    yield sse_frame(usage_chunk(self._usage(group)))
            except DecodeServerError as exc:
                # The stream is already 200: the error travels as the last frame (counted here, not by status).
                self.metrics.on_rejected(exc.status_code, exc.error_type)
                yield sse_frame(error_body(exc.message, exc.error_type, exc.status_code, exc.param))
            finally:
                # Runs on normal end, on errors, and when Starlette cancels us because the client left.
                group.abort_unfinished("client disconnected")
            yield DONE_FRAME

        return StreamingResponse(frames(), media_type="text/event-stream", headers=SSE_HEADERS)
