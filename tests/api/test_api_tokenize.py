"""POST /tokenize and /detokenize (vLLM's) on the shared server: the ids are the server's own (a completion of those
ids is the completion of the text; a conversation's count is the chat route's prompt_tokens), detokenize inverts
tokenize, a text longer than the context is counted, and bad bodies get a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest
from api_server_harness import API_KEY, CONTEXT_LENGTH, ServerProcess

from decode_server.model import Tokenizer, resolve_model_path

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
TEXT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]


def _post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=HEADERS, timeout=60)


def _ok(server: ServerProcess, path: str, body: dict) -> dict:
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def test_tokenize_a_prompt_as_the_server_does(dense_server: ServerProcess) -> None:
    tokenizer = Tokenizer.from_dir(resolve_model_path("tiny-dsa"))
    out = _ok(dense_server, "/tokenize", {"prompt": TEXT, "return_token_strs": True})
    assert out["tokens"] == tokenizer.encode(TEXT) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == CONTEXT_LENGTH
    assert out["token_strs"] == [tokenizer.decode([t], skip_special_tokens=False) for t in out["tokens"]]
    bare = _ok(dense_server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False})
    assert bare["tokens"] == tokenizer.encode(TEXT, add_special_tokens=False) and bare["token_strs"] is None
    # the ids are what the completion route makes of the text
    by_text = _ok(dense_server, "/v1/completions", {"prompt": TEXT, "max_tokens": 4, "temperature": 0})
    by_ids = _ok(dense_server, "/v1/completions", {"prompt": out["tokens"], "max_tokens": 4, "temperature": 0})
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == by_text["usage"]["prompt_tokens"] == out["count"]


def test_tokenize_a_conversation_through_the_chat_template(dense_server: ServerProcess) -> None:
    out = _ok(dense_server, "/tokenize", {"messages": MESSAGES})
    chat = _ok(dense_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert out["count"] == chat["usage"]["prompt_tokens"]
    without_prompt = _ok(dense_server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert without_prompt["count"] < out["count"]
    assert out["tokens"][: without_prompt["count"]] == without_prompt["tokens"]


def test_detokenize_inverts_tokenize_and_long_texts_are_counted(dense_server: ServerProcess) -> None:
    ids = _ok(dense_server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False})["tokens"]
    assert _ok(dense_server, "/detokenize", {"tokens": ids}) == {"prompt": TEXT}
    long_text = " ".join(f"word{i}" for i in range(400))
    counted = _ok(dense_server, "/tokenize", {"prompt": long_text})
    assert counted["count"] > CONTEXT_LENGTH  # counted, not refused: nothing is generated


@pytest.mark.parametrize(("path", "body", "param", "needle"), [
    ("/tokenize", {"prompt": TEXT, "messages": MESSAGES}, "prompt", "exactly one"),
    ("/tokenize", {}, "prompt", "exactly one"),
    ("/tokenize", {"prompt": TEXT, "model": "other"}, "model", "not served"),
    ("/tokenize", {"messages": []}, "messages", "at least 1"),
    ("/tokenize", {"prompt": 5}, "prompt", "string"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens.1", "vocabulary"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0", "greater than"),
    ("/detokenize", {}, "tokens", "missing"),
])
def test_refusals(dense_server: ServerProcess, path: str, body: dict, param: str, needle: str) -> None:
    r = _post(dense_server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error
