"""Tokenizer of a checkpoint directory: `tokenizer.json` through `tokenizers`, chat template through jinja2.

This is the path a real DeepSeek checkpoint uses: the BPE model, normalizer and post-processor (which adds the
BOS token) come from `tokenizer.json`; special tokens and the chat template come from `tokenizer_config.json`,
or the template from `chat_template.jinja` next to it (where transformers ≥ 4.5x writes it; GLM-5 ships it so).
A rendered chat prompt already starts with the BOS text, so encode it with `add_special_tokens=False`.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens either as strings or as {"content": ...} objects."""
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any]) -> None:
        self._tok = tokenizer
        self.config = config
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.chat_template = self._select_template(config.get("chat_template"))
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        self._compiled = env.from_string(self.chat_template) if self.chat_template else None

    @staticmethod
    def _select_template(template: Any) -> str | None:
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {entry["name"]: entry["template"] for entry in template}
            return named.get("default") or next(iter(named.values()), None)
        return template

    @classmethod
    def from_dir(cls, path: str | Path, chat_template: str | None = None) -> Tokenizer:
        """`chat_template`: Jinja text that replaces the checkpoint's own (`--chat-template`)."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.exists():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        template_file = path / "chat_template.jinja"
        if not config.get("chat_template") and template_file.exists():
            config["chat_template"] = template_file.read_text()
        if chat_template is not None:
            config["chat_template"] = chat_template
        return cls(HFTokenizer.from_file(str(tokenizer_file)), config)


    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encoded_vocab(self) -> list[str]:
        """Every token's string as the tokenizer stores it (byte-level BPE: bytes mapped to printable characters),
        indexed by id; ids the vocabulary skips are empty strings (grammar compilers need the whole table)."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        table = [""] * (max(vocab.values(), default=-1) + 1)
        for token, token_id in vocab.items():
            table[token_id] = token
        return table

    def backend_json(self) -> dict[str, Any]:
        """tokenizer.json as a dict (what its decoder and pre-tokenizer are: grammar compilers need the encoding)."""
        return json.loads(self._tok.to_str())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render the conversation with the checkpoint's template (same variables transformers passes)."""
        if self._compiled is None:
            raise ValueError("this tokenizer has no chat_template in tokenizer_config.json")
        return self._compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )


def read_chat_template(path: str | Path) -> str:
    """A `--chat-template` file's text, compiled once to fail at start-up (ValueError naming the file and the line)
    rather than on the first chat request."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"--chat-template {path}: cannot read it ({exc.strerror or exc})") from exc
    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template {path}: line {exc.lineno}: {exc.message}") from exc
    return text
