"""Offline generation: `LLM(model).generate(prompts, sampling)` — a thin loop over `Engine`.

Prompts are strings (tokenized with the model's tokenizer) or token id lists; all of them are queued at once
and run with continuous batching. Outputs come back in prompt order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from decode_server.config import EngineConfig
from decode_server.engine.engine import Engine
from decode_server.engine.sampling_params import SamplingParams
from decode_server.engine.types import GenerationOutput

Prompt = str | list[int]


class LLM:
    """`LLM("tiny-dsa", device="cpu", enable_hisparse=True, ...)`: keyword arguments are `EngineConfig` fields."""

    def __init__(self, model: str = "tiny-dsa", *, engine: Engine | None = None, **engine_args: Any) -> None:
        self.engine = engine if engine is not None else Engine(EngineConfig(model_path=model, **engine_args))
        self._next_id = 0

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        batch = _as_prompt_list(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(batch)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(f"{len(batch)} prompts but {len(params)} sampling params")
        rids: list[str] = []
        results: dict[str, dict[str, Any]] = {}
        try:
            for prompt, p in zip(batch, params, strict=True):
                ids = self._encode(prompt)
                rid = f"llm-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(rid, ids, p)
                rids.append(rid)
                results[rid] = {"prompt": prompt if isinstance(prompt, str) else None, "ids": ids, "tokens": [],
                                "text": [], "logprobs": [], "finish": None, "stop": None, "prompt_logprobs": None}
            pending = set(rids)
            while pending:
                for delta in self.engine.step():
                    out = results.get(delta.rid)
                    if out is None:
                        continue
                    out["tokens"].extend(delta.new_token_ids)
                    out["text"].append(delta.text)
                    if delta.logprobs:
                        out["logprobs"].extend(delta.logprobs)
                    if delta.prompt_logprobs is not None:
                        out["prompt_logprobs"] = delta.prompt_logprobs
                    if delta.finished:
                        out["finish"], out["stop"] = delta.finish_reason, delta.stop_reason
                        pending.discard(delta.rid)
            self.engine.flush()  # overlap scheduling: the pass still in flight only carries dropped tokens
        except BaseException:
            for rid in rids:
                self.engine.abort_request(rid)
            raise
        return [
            GenerationOutput(
                prompt=r["prompt"], prompt_token_ids=r["ids"], token_ids=r["tokens"], text="".join(r["text"]),
                finish_reason=r["finish"], stop_reason=r["stop"], logprobs=r["logprobs"] or None,
                prompt_logprobs=r["prompt_logprobs"],
            )
            for r in (results[rid] for rid in rids)
        ]

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # a single prompt given as token ids
    return items
