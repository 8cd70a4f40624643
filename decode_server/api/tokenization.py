"""Tokenization off the event loop: prompts are encoded (and chat templates rendered) in worker processes.

The `tokenizers` library holds the GIL while it encodes (about 2 s for a 1 MB prompt on one core), so a thread
would still stall every other request and `/health`; worker processes do not (SGLang likewise keeps its tokenizer
apart from its scheduler). Short texts are encoded inline, where the round trip to a worker would cost more than
the work. A cheap bound comes first: a token never covers more characters than the longest entry of the
vocabulary, so a text longer than `context_length × that` can be refused with 400 before anyone tokenizes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from decode_server.errors import TokenizerUnavailableError

logger = logging.getLogger(__name__)

INLINE_MAX_CHARS = 8192  # texts up to this size are encoded on the event loop (well under a millisecond)
DEFAULT_NUM_WORKERS = 2

_worker_tokenizer: Any = None


def _init_worker(model_dir: str, chat_template: str | None = None) -> None:
    global _worker_tokenizer
    from decode_server.model.tokenizer import Tokenizer
    from decode_server.runtime.lifetime import die_with_parent

    die_with_parent()
    # Ctrl-C reaches the whole process group; the api process shuts the pool down itself.
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_tokenizer = Tokenizer.from_dir(model_dir, chat_template=chat_template)


def _within(ids: list[int], limit: int | None) -> list[int] | int:
    """The ids, or only their count when there are `limit` or more (a refused prompt's ids are not sent back)."""
    return len(ids) if limit is not None and len(ids) >= limit else ids


def _encode(text: str, add_special_tokens: bool, limit: int | None = None) -> list[int] | int:
    return _within(_worker_tokenizer.encode(text, add_special_tokens=add_special_tokens), limit)


def _encode_chat(messages: list[dict[str, Any]], add_generation_prompt: bool, limit: int | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> list[int] | int:  # fmt: skip
    text = _worker_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 **(template_kwargs or {}))
    return _within(_worker_tokenizer.encode(text, add_special_tokens=False), limit)


def chat_chars(messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None) -> int:
    """Characters of what a chat template renders from the request: messages' contents and calls, and the extra
    variables (tools). Decides inline against worker rendering, and bounds the prompt before rendering it."""
    chars = sum(len(m.get("content") or "") for m in messages)
    chars += sum(len(json.dumps(m["tool_calls"], ensure_ascii=False)) for m in messages if m.get("tool_calls"))
    if template_kwargs:
        chars += len(json.dumps(template_kwargs, ensure_ascii=False, default=str))
    return chars


def max_token_chars(tokenizer: Any) -> int:
    """Characters the longest vocabulary entry spells (an upper bound on the characters one token covers:
    byte-level entries spell one character per byte, and a character is at least one byte)."""
    vocab = tokenizer._tok.get_vocab(with_added_tokens=True)
    return max((len(token) for token in vocab), default=1) or 1


class TokenizerPool:
    """Worker processes that each load the checkpoint's tokenizer; `await encode(...)` from the event loop."""

    def __init__(self, tokenizer: Any, model_dir: str, num_workers: int = DEFAULT_NUM_WORKERS,
                 chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer  # the api process's own copy, for short texts
        self.model_dir = model_dir
        self.chat_template = chat_template  # --chat-template's text (None: the checkpoint's)
        self.num_workers = max(1, num_workers)
        self.max_token_chars = max_token_chars(tokenizer)
        self._executor = self._new_executor()

    def _new_executor(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            self.num_workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
            initargs=(self.model_dir, self.chat_template),
        )

    async def start(self) -> None:
        """Start every worker now (not on the first long prompt), so that they exist before the server is ready."""
        await asyncio.gather(*(self._run(_encode, "warm-up", True) for _ in range(self.num_workers)))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def lower_bound_tokens(self, num_chars: int) -> int:
        return -(-num_chars // self.max_token_chars)

    async def encode(self, text: str, add_special_tokens: bool = True, limit: int | None = None) -> list[int] | int:
        """Token ids of `text`; only their number when it is `limit` or more."""
        if len(text) <= INLINE_MAX_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await self._run(_encode, text, add_special_tokens, limit)

    async def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          limit: int | None = None, template_kwargs: dict[str, Any] | None = None,
                          ) -> list[int] | int:  # fmt: skip
        """Token ids of the rendered conversation (`template_kwargs`: extra template variables, the request's
        chat_template_kwargs); only their number when it is `limit` or more."""
        if chat_chars(messages, template_kwargs) <= INLINE_MAX_CHARS:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      **(template_kwargs or {}))
            return self.tokenizer.encode(text, add_special_tokens=False)
        return await self._run(_encode_chat, messages, add_generation_prompt, limit, template_kwargs)

    async def _run(self, fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, fn, *args)
        except BrokenProcessPool:
            logger.error("a tokenizer worker died; starting a new pool")
            with contextlib.suppress(Exception):
                self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = self._new_executor()
            raise TokenizerUnavailableError("a tokenizer worker died while encoding this prompt; retry") from None
