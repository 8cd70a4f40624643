"""POST /generate, SGLang's native generation API, for clients and routers written against SGLang (its PD router
sends `/generate` to both servers with the bootstrap fields).

The body (native_protocol.py) is translated into this server's CompletionRequest, so validation, PD bootstrap,
limits and sampling are exactly those of /v1/completions; only the names and the response differ:

    {"text": ..., "output_ids": [...], "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens",
     "cached_tokens", "e2e_latency", ["output_token_logprobs", "output_top_logprobs"]}}

`finish_reason` is SGLang's object: `{"type": "length", "length": N}`, `{"type": "stop", "matched": <stop string or
token id>}` (no `matched` when the request ended at EOS without one being reported), `{"type": "abort"}`; null
while a stream runs. Logprob entries are `[logprob, token_id, text or null]` (text with `return_text_in_logprobs`).

A batch (a list of texts or of id lists, or `n` > 1) answers a list, ordered as SGLang orders it: sample-major
(all prompts of sample 0, then of sample 1, ...). A stream sends, per event, the whole output of one choice so far
(SGLang's default, non-incremental streaming; a batch's events carry their `index`), then `data: [DONE]`.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from decode_server.api.generation import ChoiceSpec, ChoiceState, GenerationGroup
from decode_server.api.native_protocol import DEFAULT_MAX_NEW_TOKENS, GenerateRequest, NativeSamplingParams
from decode_server.api.protocol import CompletionRequest
from decode_server.engine.types import TokenLogprob
from decode_server.errors import DecodeServerError, InvalidRequestError

# This server's (OpenAI) parameter names → where they are in a /generate body.
_NATIVE_PARAM = {
    "max_tokens": "sampling_params.max_new_tokens", "min_tokens": "sampling_params.min_new_tokens",
    "seed": "sampling_params.sampling_seed", "response_format": "sampling_params.json_schema",
    "logprobs": "top_logprobs_num", "prompt_logprobs": "logprob_start_len",
    **{name: f"sampling_params.{name}" for name in (
        "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "n",
        "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "regex", "ebnf")},
}


def native_param(param: str | None, prompt_field: str) -> str | None:
    """A refusal's parameter as a /generate client names it."""
    if param is None:
        return None
    head, _, rest = param.partition(".")
    if head == "prompt":
        return prompt_field + (f".{rest}" if rest else "")
    mapped = _NATIVE_PARAM.get(head)
    return param if mapped is None else mapped + (f".{rest}" if rest else "")


def _refuse(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def as_completion(req: GenerateRequest) -> tuple[CompletionRequest, str, bool]:
    """(the equivalent CompletionRequest, the prompt's field name, whether the answer is a batch)."""
    given = [name for name in ("text", "input_ids") if getattr(req, name) is not None]
    if len(given) != 1:
        raise _refuse("give exactly one of 'text' and 'input_ids'", "text")
    prompt_field = given[0]
    sp = req.sampling_params or NativeSamplingParams()
    if sp.no_stop_trim:
        raise _refuse("'no_stop_trim' is not supported (a matched stop string is always cut)",
                      "sampling_params.no_stop_trim")
    if not sp.spaces_between_special_tokens:
        raise _refuse("'spaces_between_special_tokens: false' is not supported",
                      "sampling_params.spaces_between_special_tokens")
    response_format = None
    if sp.json_schema is not None:
        try:
            schema = json.loads(sp.json_schema)
        except ValueError as exc:
            raise _refuse(f"'json_schema' is not JSON: {exc}", "sampling_params.json_schema") from None
        if not isinstance(schema, dict):
            raise _refuse("'json_schema' must be a JSON object", "sampling_params.json_schema")
        response_format = {"type": "json_schema", "json_schema": {"schema": schema}}
    prompt = req.text if req.text is not None else req.input_ids
    fields: dict[str, Any] = {
        "prompt": prompt, "max_tokens": sp.max_new_tokens, "min_tokens": sp.min_new_tokens,
        "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k, "seed": sp.sampling_seed,
        "stop": sp.stop, "stop_token_ids": sp.stop_token_ids, "ignore_eos": sp.ignore_eos,
        "skip_special_tokens": sp.skip_special_tokens, "n": sp.n, "repetition_penalty": sp.repetition_penalty,
        "frequency_penalty": sp.frequency_penalty, "presence_penalty": sp.presence_penalty,
        "logit_bias": sp.logit_bias, "regex": sp.regex, "ebnf": sp.ebnf, "response_format": response_format,
        "logprobs": req.top_logprobs_num if req.return_logprob else None, "rid": req.rid, "priority": req.priority,
        "bootstrap_host": req.bootstrap_host, "bootstrap_port": req.bootstrap_port,
        "bootstrap_room": req.bootstrap_room, "bootstrap_auth": req.bootstrap_auth,
    }
    try:
        completion = CompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        raise InvalidRequestError(f"invalid value for '{native_param(param, prompt_field)}': {first.get('msg')}",
                                  param=native_param(param, prompt_field)) from None
    batch = sp.n > 1 or isinstance(req.text, list) or bool(req.input_ids and isinstance(req.input_ids[0], list))
    return completion, prompt_field, batch


def finish_reason(choice: ChoiceState) -> dict[str, Any] | None:
    """SGLang's finish reason object (None while the choice runs)."""
    if not choice.finished:
        return None
    if choice.finish_reason == "length":
        return {"type": "length", "length": choice.completion_tokens}
    if choice.finish_reason == "stop":
        return {"type": "stop"} if choice.stop_reason is None else {"type": "stop", "matched": choice.stop_reason}
    return {"type": "abort"}


class NativeGeneration:
    """The /generate handler, on top of the OpenAI handlers' validation, PD bootstrap and delivery."""

    def __init__(self, serving: Any) -> None:
        self.serving = serving  # serving.OpenAIServing

    def _logprob(self, token_id: int, logprob: float | None, with_text: bool) -> list[Any]:
        return [logprob, token_id, self.serving._token_text(token_id) if with_text else None]

    def _output(self, choice: ChoiceState, group: GenerationGroup, batch: bool, req: GenerateRequest,
                logprobs: list[TokenLogprob]) -> dict[str, Any]:  # fmt: skip
        meta: dict[str, Any] = {
            "id": choice.rid if batch else group.request_id, "finish_reason": finish_reason(choice),
            "prompt_tokens": choice.prompt_tokens, "completion_tokens": choice.completion_tokens,
            "cached_tokens": choice.cached_tokens, "e2e_latency": round(time.monotonic() - group.arrival, 6),
        }
        if req.return_logprob:
            text = req.return_text_in_logprobs
            meta["output_token_logprobs"] = [self._logprob(lp.token_id, lp.logprob, text) for lp in logprobs]
            meta["output_top_logprobs"] = [[self._logprob(t, v, text) for t, v in lp.top_logprobs]
                                           for lp in logprobs]  # fmt: skip
            if req.logprob_start_len >= 0:  # the prompt's from that position (the first token's logprob is null)
                start = req.logprob_start_len
                ids = choice.spec.prompt_token_ids[start:]
                known = (choice.prompt_logprobs or [None] * len(choice.spec.prompt_token_ids))[start:]
                meta["input_token_logprobs"] = [self._logprob(t, None if lp is None else lp.logprob, text)
                                                for t, lp in zip(ids, known, strict=True)]  # fmt: skip
                meta["input_top_logprobs"] = [None if lp is None else [self._logprob(t, v, text)
                                                                       for t, v in lp.top_logprobs]
                                              for lp in known]  # fmt: skip
        out: dict[str, Any] = {"text": choice.text, "output_ids": list(choice.token_ids), "meta_info": meta}
        if batch:
            out["index"] = choice.spec.index
        return out

    async def generate(self, req: GenerateRequest, raw: Request) -> Any:
        completion, prompt_field, batch = as_completion(req)
        try:
            return await self._generate(req, completion, batch, raw)
        except DecodeServerError as exc:
            exc.param = native_param(exc.param, prompt_field)
            raise

    async def _generate(self, req: GenerateRequest, completion: CompletionRequest, batch: bool, raw: Request) -> Any:
        serving = self.serving
        prompts = await serving._completion_prompts(completion)
        bootstraps = serving._bootstrap(completion, len(prompts))
        logprobs = completion.logprobs
        prompt_logprobs = logprobs if req.return_logprob and req.logprob_start_len >= 0 else None
        if prompt_logprobs is not None and any(req.logprob_start_len >= len(ids) for ids in prompts):
            raise InvalidRequestError("'logprob_start_len' must be less than the prompt's length in tokens",
                                      param="logprob_start_len")
        specs = []
        for k in range(completion.n):  # sample-major, as SGLang orders a batch
            for p_index, ids in enumerate(prompts):
                max_tokens = serving._max_tokens(completion.max_tokens, len(ids), DEFAULT_MAX_NEW_TOKENS)
                specs.append(ChoiceSpec(index=k * len(prompts) + p_index, prompt_token_ids=ids, prompt_index=p_index,
                                        params=serving._sampling_params(completion, max_tokens, logprobs, k,
                                                                        prompt_logprobs=prompt_logprobs),
                                        bootstrap=bootstraps[p_index]))  # fmt: skip
        group = serving._new_group("gen", specs, completion.rid)

        def event(choice: ChoiceState, text: str, lps: list[TokenLogprob], finish: str | None) -> dict[str, Any]:
            return self._output(choice, group, batch, req, choice.logprobs)

        def final(_usage: Any) -> Any:
            outs = [self._output(c, group, batch, req, c.logprobs) for c in group.choices]
            return outs if batch else outs[0]

        await group.submit()
        if req.stream:
            return serving._stream(group, raw, None, event, None)
        return await serving._collect(group, raw, final)
