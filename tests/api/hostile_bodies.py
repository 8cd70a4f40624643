"""Hand-written hostile request bodies (raw bytes, since several are not what a JSON encoder would produce).

Each entry: (name, route, body). Every one must get a response below 500 (most are 400; a few legal oddities are
served with 200). Generation is kept to a few tokens wherever a body is valid. Used by test_api_hostile.py and by
the soak benchmark (benchmarks/soak.py) as its "bad bodies".
"""

from __future__ import annotations

import json

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MB = 1 << 20


def _c(extra: str) -> bytes:
    return ('{"model": "tiny-dsa", "max_tokens": 2, ' + extra + "}").encode()


def _chat(extra: str) -> bytes:
    return ('{"model": "tiny-dsa", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], ' + extra
            + "}").encode()


def _nested(depth: int) -> bytes:
    return ('{"model": "tiny-dsa", "prompt": ' + "[" * depth + "]" * depth + "}").encode()


HOSTILE_BODIES: list[tuple[str, str, bytes]] = [
    # invalid Unicode: lone surrogates in every kind of string
    ("lone high surrogate prompt", COMPLETIONS, _c('"prompt": "ab\\ud800cd"')),
    ("lone low surrogate prompt", COMPLETIONS, _c('"prompt": "\\udfff"')),
    ("surrogate in prompt list", COMPLETIONS, _c('"prompt": ["ok", "\\ud800"]')),
    ("surrogate in stop", COMPLETIONS, _c('"prompt": "x", "stop": "\\ud800"')),
    ("surrogate in model", COMPLETIONS, _c('"prompt": "x", "model": "\\ud800"')),
    ("surrogate in a key", COMPLETIONS, _c('"prompt": "x", "\\ud800": 1')),
    ("surrogate in chat content", CHAT, _chat('"user": "u"').replace(b'"hi"', b'"\\ud800"')),
    ("surrogate in content part", CHAT, b'{"model": "tiny-dsa", "max_tokens": 2, "messages": [{"role": "user", '
                                        b'"content": [{"type": "text", "text": "\\udc00"}]}]}'),
    ("surrogate in role", CHAT, b'{"messages": [{"role": "\\ud800", "content": "x"}]}'),
    ("raw invalid UTF-8 bytes", COMPLETIONS, b'{"model": "tiny-dsa", "prompt": "\xff\xfe\xc0", "max_tokens": 2}'),
    # non-finite and huge numbers
    ("NaN temperature", COMPLETIONS, _c('"prompt": "x", "temperature": NaN')),
    ("Infinity top_p", COMPLETIONS, _c('"prompt": "x", "top_p": Infinity')),
    ("-Infinity temperature", CHAT, _chat('"temperature": -Infinity')),
    ("NaN max_tokens", COMPLETIONS, b'{"prompt": "x", "max_tokens": NaN}'),
    ("1e400 max_tokens", COMPLETIONS, b'{"prompt": "x", "max_tokens": 1e400}'),
    ("10^400 max_tokens", COMPLETIONS, ('{"prompt": "x", "max_tokens": 1' + "0" * 400 + "}").encode()),
    ("huge n", COMPLETIONS, _c('"prompt": "x", "n": 99999999999999999999999')),
    ("huge seed", COMPLETIONS, _c('"prompt": "x", "seed": 184467440737095516160000')),
    ("negative seed", COMPLETIONS, _c('"prompt": "x", "seed": -1')),
    ("huge top_k", COMPLETIONS, _c('"prompt": "x", "top_k": 99999999999999999999')),
    ("huge token id", COMPLETIONS, _c('"prompt": [1, 99999999999999999999999]')),
    ("negative token id", COMPLETIONS, _c('"prompt": [1, -5]')),
    ("huge stop_token_ids", COMPLETIONS, _c('"prompt": "x", "stop_token_ids": [99999999999999999999]')),
    ("huge logprobs", COMPLETIONS, _c('"prompt": "x", "logprobs": 1000000000000')),
    ("huge top_logprobs", CHAT, _chat('"logprobs": true, "top_logprobs": 1000000000000')),
    ("float max_tokens", COMPLETIONS, b'{"prompt": "x", "max_tokens": 2.5}'),
    # large strings
    ("1 MB prompt", COMPLETIONS, _c(json.dumps({"prompt": "a" * MB})[1:-1])),
    ("1 MB chat message", CHAT, json.dumps({"model": "tiny-dsa", "max_tokens": 2,
                                            "messages": [{"role": "user", "content": "word " * (MB // 5)}]}).encode()),
    ("1 MB stop string", COMPLETIONS, _c(json.dumps({"prompt": "x", "stop": "s" * MB})[1:-1])),
    ("1 MB model name", COMPLETIONS, _c(json.dumps({"prompt": "x", "model": "m" * MB})[1:-1])),
    ("1 MB user", CHAT, _chat(json.dumps({"user": "u" * MB})[1:-1])),
    ("1 MB unknown field", COMPLETIONS, _c(json.dumps({"prompt": "x", "junk": "j" * MB})[1:-1])),
    ("100k-element prompt list", COMPLETIONS, _c(json.dumps({"prompt": ["a"] * 100_000})[1:-1])),
    ("many messages", CHAT, json.dumps({"model": "tiny-dsa", "max_tokens": 2,
                                        "messages": [{"role": "user", "content": "x"}] * 20_000}).encode()),
    # deep nesting
    ("nested 100 arrays", COMPLETIONS, _nested(100)),
    ("nested 100000 arrays", COMPLETIONS, _nested(100_000)),
    ("nested objects", COMPLETIONS, b'{"prompt": "x", "stream_options": ' + b'{"a": ' * 50_000 + b"1"
                                    + b"}" * 50_000 + b"}"),
    ("nested content parts", CHAT, b'{"messages": [{"role": "user", "content": [[[[[{"type": "text"}]]]]]}]}'),
    # wrong types
    ("stream as string", COMPLETIONS, _c('"prompt": "x", "stream": "yes"')),
    ("stream as int", COMPLETIONS, _c('"prompt": "x", "stream": 1')),
    ("max_tokens as string", COMPLETIONS, b'{"prompt": "x", "max_tokens": "5"}'),
    ("n as bool", COMPLETIONS, _c('"prompt": "x", "n": true')),
    ("prompt as object", COMPLETIONS, _c('"prompt": {"text": "x"}')),
    ("prompt as number", COMPLETIONS, _c('"prompt": 42')),
    ("prompt as null", COMPLETIONS, _c('"prompt": null')),
    ("mixed prompt list", COMPLETIONS, _c('"prompt": ["a", 1, [2]]')),
    ("messages as string", CHAT, b'{"messages": "hi"}'),
    ("message as list", CHAT, b'{"messages": [["user", "hi"]]}'),
    ("content as number", CHAT, b'{"messages": [{"role": "user", "content": 5}]}'),
    ("stop as number", COMPLETIONS, _c('"prompt": "x", "stop": 5')),
    ("stop_options as list", COMPLETIONS, _c('"prompt": "x", "stream": true, "stream_options": [true]')),
    ("logit_bias as list", COMPLETIONS, _c('"prompt": "x", "logit_bias": [1]')),
    ("tool role", CHAT, b'{"max_tokens": 2, "messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}'),
    ("unknown role", CHAT, b'{"messages": [{"role": "root", "content": "x"}]}'),
    # not an object / not JSON
    ("empty body", COMPLETIONS, b""),
    ("null", COMPLETIONS, b"null"),
    ("array", CHAT, b"[1, 2, 3]"),
    ("string", CHAT, b'"hello"'),
    ("number", COMPLETIONS, b"1e999999"),
    ("truncated", COMPLETIONS, b'{"prompt": "x", "max_tokens": '),
    ("trailing garbage", COMPLETIONS, _c('"prompt": "x"') + b" garbage"),
    ("NUL bytes", COMPLETIONS, b'{"prompt": "\x00", "max_tokens": 2}'),
    ("escaped NUL prompt", COMPLETIONS, _c('"prompt": "a\\u0000b"')),
    ("BOM", COMPLETIONS, b"\xef\xbb\xbf" + _c('"prompt": "x"')),
    # duplicate keys (the last one wins in Python's json, as in most parsers)
    ("duplicate prompt", COMPLETIONS, b'{"prompt": "a", "prompt": 5, "max_tokens": 2}'),
    ("duplicate max_tokens", COMPLETIONS, b'{"prompt": "a", "max_tokens": 100000, "max_tokens": 2}'),
    ("duplicate stream", COMPLETIONS, _c('"prompt": "a", "stream": true, "stream": "no"')),
    # legal oddities
    ("emoji pair", COMPLETIONS, _c('"prompt": "\\ud83d\\ude00"')),
    ("control characters", COMPLETIONS, _c('"prompt": "\\u0001\\u001f\\t\\n"')),
    ("only whitespace", COMPLETIONS, _c('"prompt": "   "')),
    ("empty stop list", COMPLETIONS, _c('"prompt": "x", "stop": []')),
    ("empty content", CHAT, b'{"max_tokens": 2, "messages": [{"role": "user", "content": ""}]}'),
    ("null content", CHAT, b'{"max_tokens": 2, "messages": [{"role": "assistant", "content": null}]}'),
]

# Bodies that are legal and served (200); every other one must be refused with a 4xx.
LEGAL = frozenset({"duplicate max_tokens", "emoji pair", "control characters", "only whitespace", "empty stop list",
                   "empty content", "null content", "escaped NUL prompt", "1 MB user", "1 MB unknown field",
                   "1 MB stop string", "huge top_k", "huge stop_token_ids", "BOM"})
