"""Structured outputs: OpenAI's response_format `json_object` / `json_schema` and SGLang's `regex` / `ebnf`, compiled
by xgrammar (SGLang's and vLLM's default grammar backend) over the served tokenizer.

A request's grammar is compiled when it is added (a bad schema, pattern or grammar is the client's 400, before it
queues). When it is first sampled here, a matcher is made and fed the output tokens the host already knows (none
after a prefill; the prefill server's token on a PD decode server); before each later sampling the matcher writes
the bitmask of the tokens that may come next, which engine/logits_processor.py turns into −inf on the others; each
token read by the host is then accepted. Once the grammar is complete the bitmask allows only the stop tokens (EOS),
so the request ends there. The matcher needs the previous token before the next bitmask, so while a constrained
request runs, overlap scheduling reads each pass before launching the next (engine.py `step`).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import time
from typing import Any

import torch

from decode_server.engine.sampling_params import StructuredOutput

logger = logging.getLogger(__name__)

INSTALL_HINT = "structured outputs need the xgrammar package: pip install 'hisparse-decode-server[structured]'"


def _flatten(component: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """A tokenizer.json component (decoder, normalizer, pre-tokenizer), its `Sequence`s unrolled."""
    if not component:
        return []
    if component.get("type") == "Sequence":
        return [leaf for child in component.get(key, []) for leaf in _flatten(child, key)]
    return [component]


def detect_encoding(tokenizer_json: dict[str, Any]) -> tuple[str, bool]:
    """How the vocabulary spells bytes — "byte_level" (GPT-2 style BPE: DeepSeek, GLM), "byte_fallback"
    (sentencepiece with <0xNN> tokens) or "raw" — and whether encoding prepends a space (sentencepiece's ▁)."""
    decoders = {d.get("type") for d in _flatten(tokenizer_json.get("decoder"), "decoders")}
    if "ByteLevel" in decoders:
        return "byte_level", False
    if "ByteFallback" in decoders:
        normalizers = _flatten(tokenizer_json.get("normalizer"), "normalizers")
        pre = _flatten(tokenizer_json.get("pre_tokenizer"), "pretokenizers")
        prefix = any(n.get("type") == "Prepend" for n in normalizers) or any(
            p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never" for p in pre)
        return "byte_fallback", prefix
    return "raw", False


class GrammarBackend:
    """xgrammar's compiler for one tokenizer and vocabulary (the logits' width, which may exceed the tokenizer's)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int], any_whitespace: bool) -> None:
        import xgrammar  # the `structured` extra: callers catch ImportError

        start = time.perf_counter()
        self._xgr = xgrammar
        self.vocab_size = vocab_size
        self.any_whitespace = any_whitespace
        encoding, add_prefix_space = detect_encoding(tokenizer.backend_json())
        vocab = tokenizer.encoded_vocab()[:vocab_size]
        info = xgrammar.TokenizerInfo(vocab, getattr(xgrammar.VocabType, encoding.upper()), vocab_size=vocab_size,
                                      stop_token_ids=sorted(stop_token_ids), add_prefix_space=add_prefix_space)
        # Compiled grammars are cached by their text, up to a bound: clients with ever new schemas cannot grow it.
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=True, cache_limit_bytes=256 << 20)

        logger.info("structured outputs: xgrammar %s over %d tokens (%s) ready in %.2f s",
                    importlib.metadata.version("xgrammar"), vocab_size, encoding, time.perf_counter() - start)

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar (xgrammar caches it by its text); ValueError naming what is wrong with it."""
        try:
            if spec.kind == "json_object":
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=self.any_whitespace)
            if spec.kind == "json_schema":
                json.loads(spec.spec)
                return self._compiler.compile_json_schema(spec.spec, any_whitespace=self.any_whitespace)
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.spec)
            return self._compiler.compile_grammar(spec.spec)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError / TypeError by case
            what = {"json_object": "JSON", "json_schema": "JSON schema", "regex": "regex", "ebnf": "EBNF grammar"}
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"invalid {what[spec.kind]}: {first_line[:300]}") from exc

    def matcher(self, compiled: Any, known_tokens: list[int]) -> Any:
        """A matcher at the grammar's start, advanced over the output tokens generated so far."""
        matcher = self._xgr.GrammarMatcher(compiled)
        for token in known_tokens:
            if not matcher.accept_token(token):
                raise ValueError(f"token {token} of the output so far does not match the grammar")
        return matcher

    def bitmask(self, matchers: list[Any]) -> torch.Tensor:
        """int32 [len(matchers), ceil(vocab / 32)] on the host: bit t of row k set when token t may follow."""
        mask = self._xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        # One row after the other: xgrammar's BatchGrammarMatcher (threads) cost ~3.8 ms a call on the H200's host
        # whatever the rows (docs/benchmarks.md "Sampling"), more than serial filling up to ~40 rows in a string.
        for k, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(mask, k)
        return mask


def build_grammar_backend(backend: str, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int],
                          any_whitespace: bool) -> tuple[GrammarBackend | None, str | None]:
    """The engine's backend, or None and why structured outputs are refused (flag, package or tokenizer)."""
    if backend == "none":
        return None, "structured outputs are off on this server (--grammar-backend none)"
    if tokenizer is None:
        return None, "structured outputs need the model's tokenizer"
    try:
        return GrammarBackend(tokenizer, vocab_size, stop_token_ids, any_whitespace), None
    except ImportError:
        logger.warning("%s; constrained requests will be refused", INSTALL_HINT)
        return None, INSTALL_HINT


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask [n, words] (any device) → bool [n, vocab_size], True where a token may come next."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # an arithmetic shift: bit 31 of a negative word still reads 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
