"""POST /generate (SGLang's native API) on the shared server: greedy outputs equal the offline engine's (tokens,
text, logprobs bit for bit), batches and `n` in SGLang's sample-major order, SGLang's finish-reason objects, a stream
of cumulative outputs whose last equals the whole response, an abort by `rid`, structured output by `json_schema`,
and refusals naming SGLang's field names. PD with /generate: tests/disagg/test_pd_servers.py."""

from __future__ import annotations

import json

import httpx
import pytest
from api_server_harness import API_KEY, ServerProcess

from decode_server.engine.llm import LLM
from decode_server.engine.sampling_params import SamplingParams
from decode_server.model import Tokenizer, resolve_model_path

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = ["The quick brown fox", "A cat sat on"]
IDS = [5, 6, 7, 300, 41]


def _post(server: ServerProcess, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + "/generate", json=body, headers=HEADERS, timeout=timeout)


def _ok(server: ServerProcess, body: dict):
    r = _post(server, body)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server: ServerProcess, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, headers=HEADERS,
                      timeout=60) as r:  # fmt: skip
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        events.append(json.loads(line[len("data: "):]))
    return events


def test_greedy_equals_the_offline_engine(dense_server: ServerProcess, offline_llm: LLM) -> None:
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    (expected,) = offline_llm.generate([PROMPTS[0]], params)
    out = _ok(dense_server, {"text": PROMPTS[0], "return_logprob": True, "top_logprobs_num": 2,
                             "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    assert out["text"] == expected.text and out["output_ids"] == expected.token_ids
    meta = out["meta_info"]
    assert meta["id"].startswith("gen-") and meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(expected.prompt_token_ids), 6)
    assert meta["e2e_latency"] > 0 and meta["cached_tokens"] == 0
    assert meta["output_token_logprobs"] == [[lp.logprob, lp.token_id, None] for lp in expected.logprobs]
    assert meta["output_top_logprobs"] == [[[v, t, None] for t, v in lp.top_logprobs] for lp in expected.logprobs]
    # token ids in, text of the logprobs out
    (by_ids,) = offline_llm.generate([IDS], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=0))
    out = _ok(dense_server, {"input_ids": IDS, "return_logprob": True, "return_text_in_logprobs": True,
                             "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}})
    tokenizer = Tokenizer.from_dir(resolve_model_path("tiny-dsa"))
    assert out["output_ids"] == by_ids.token_ids and out["meta_info"]["prompt_tokens"] == len(IDS)
    assert [e[1:] for e in out["meta_info"]["output_token_logprobs"]] == [
        [t, tokenizer.decode([t], skip_special_tokens=False)] for t in by_ids.token_ids]
    assert out["meta_info"]["output_top_logprobs"] == [[]] * 3
    assert "output_token_logprobs" not in _ok(dense_server, {"input_ids": IDS})["meta_info"]


def test_input_token_logprobs_from_logprob_start_len(dense_server: ServerProcess, offline_llm: LLM) -> None:
    (expected,) = offline_llm.generate([IDS], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                                             prompt_logprobs=1, logprobs=1))  # fmt: skip
    body = {"input_ids": IDS, "return_logprob": True, "top_logprobs_num": 1,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}
    whole = _ok(dense_server, {**body, "logprob_start_len": 0})["meta_info"]
    assert whole["input_token_logprobs"][0] == [None, IDS[0], None] and whole["input_top_logprobs"][0] is None
    assert whole["input_token_logprobs"][1:] == [[x.logprob, x.token_id, None] for x in expected.prompt_logprobs[1:]]
    assert whole["input_top_logprobs"][1:] == [[[v, t, None] for t, v in x.top_logprobs]
                                               for x in expected.prompt_logprobs[1:]]  # fmt: skip
    tail = _ok(dense_server, {**body, "logprob_start_len": 3})["meta_info"]
    assert tail["input_token_logprobs"] == whole["input_token_logprobs"][3:]
    assert "input_token_logprobs" not in _ok(dense_server, body)["meta_info"]  # -1: the output's only


def test_batches_and_n_in_sample_major_order(dense_server: ServerProcess, offline_llm: LLM) -> None:
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    expected = [o.text for o in offline_llm.generate(PROMPTS, params)]
    outs = _ok(dense_server, {"text": PROMPTS, "rid": "batch-1",
                              "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "n": 2}})
    assert [o["text"] for o in outs] == expected * 2  # sample 0 of both prompts, then sample 1
    assert [o["index"] for o in outs] == [0, 1, 2, 3]
    assert [o["meta_info"]["id"] for o in outs] == [f"batch-1-{i}" for i in range(4)]
    # n > 1 of one prompt is a batch too; a seeded sample differs between its choices
    sampled = _ok(dense_server, {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 8, "n": 2,
                                                                         "sampling_seed": 3, "ignore_eos": True}})
    assert isinstance(sampled, list) and len(sampled) == 2 and sampled[0]["output_ids"] != sampled[1]["output_ids"]
    again = _ok(dense_server, {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 8, "n": 2,
                                                                       "sampling_seed": 3, "ignore_eos": True}})
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in sampled]


def test_finish_reasons(dense_server: ServerProcess, offline_llm: LLM) -> None:
    (free,) = offline_llm.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    stop_token = free.token_ids[2]
    by_token = _ok(dense_server, {"text": PROMPTS[1], "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "stop_token_ids": [stop_token]}})
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_token}
    assert by_token["output_ids"] == free.token_ids[:3]
    stop_text = free.text[len(free.text) // 2:][:3]
    by_text = _ok(dense_server, {"text": PROMPTS[1], "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "stop": [stop_text]}})
    assert by_text["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_text}
    assert stop_text not in by_text["text"] and free.text.startswith(by_text["text"])


def test_stream_sends_cumulative_outputs(dense_server: ServerProcess) -> None:
    body = {"text": PROMPTS[0], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    whole = _ok(dense_server, body)
    events = _stream(dense_server, body)
    assert len(events) == 5 and all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    for i, event in enumerate(events):
        assert event["output_ids"] == whole["output_ids"][: i + 1]
        assert whole["text"].startswith(event["text"])
        assert len(event["meta_info"]["output_token_logprobs"]) == i + 1
    last = events[-1]
    assert (last["text"], last["output_ids"], last["meta_info"]["finish_reason"]) == (
        whole["text"], whole["output_ids"], whole["meta_info"]["finish_reason"])
    assert last["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]
    batch = _stream(dense_server, {"text": PROMPTS, "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                                        "ignore_eos": True}})
    finals = {e["index"]: e for e in batch if e["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1] and all(len(e["output_ids"]) == 3 for e in finals.values())


def test_abort_by_rid_ends_the_stream(dense_server: ServerProcess) -> None:
    body = {"text": PROMPTS[0], "rid": "native-abort", "stream": True,
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    events = []
    with httpx.stream("POST", dense_server.url + "/generate", json=body, headers=HEADERS, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            events.append(json.loads(line[len("data: "):]))
            if len(events) == 2:
                aborted = httpx.post(dense_server.url + "/abort_request", json={"rid": "native-abort"},
                                     headers=HEADERS, timeout=10)  # fmt: skip
                assert aborted.json() == {"aborted": 1}
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "abort"}
    assert events[-1]["meta_info"]["id"] == "native-abort" and len(events[-1]["output_ids"]) < 200


def test_json_schema_constrains_the_output(dense_server: ServerProcess) -> None:
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    out = _ok(dense_server, {"text": PROMPTS[0], "sampling_params": {
        "max_new_tokens": 60, "temperature": 0, "json_schema": json.dumps(schema)}})
    assert json.loads(out["text"])["colour"] in ("red", "blue"), out
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"text": "a", "input_ids": [1]}, "text", "exactly one"),
    ({}, "text", "exactly one"),
    ({"text": "a", "sampling_params": [{"max_new_tokens": 2}]}, "sampling_params", "not a list"),
    ({"text": "a", "rid": ["x"]}, "rid", "not a list"),
    ({"text": "a", "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len", "less than"),
    ({"text": "a", "sampling_params": {"no_stop_trim": True}}, "sampling_params.no_stop_trim", "not supported"),
    ({"text": "a", "sampling_params": {"spaces_between_special_tokens": False}},
     "sampling_params.spaces_between_special_tokens", "not supported"),
    ({"text": "a", "sampling_params": {"json_schema": "{no"}}, "sampling_params.json_schema", "not JSON"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 100000}}, "sampling_params.max_new_tokens", "context"),
    ({"text": "a", "sampling_params": {"temperature": 5}}, "sampling_params.temperature", "less than"),
    ({"text": "a", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 3}}, "sampling_params.min_new_tokens",
     "more than"),
    ({"text": "a", "sampling_params": {"stop": [""]}}, "sampling_params.stop", "empty"),
    ({"input_ids": [10**9]}, "input_ids", "vocabulary"),
    ({"text": ""}, "text", ""),
    ({"text": "a", "rid": "bad rid!"}, "rid", "pattern"),
    ({"text": "a", "top_logprobs_num": 99}, "top_logprobs_num", "less than"),
])
def test_refusals_name_sglangs_fields(dense_server: ServerProcess, body: dict, param: str, needle: str) -> None:
    r = _post(dense_server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error


def test_sglang_info_routes(dense_server: ServerProcess) -> None:
    info = httpx.get(dense_server.url + "/get_model_info", headers=HEADERS, timeout=10).json()
    assert info["is_generation"] is True and info["context_length"] > 0
    assert info["model_path"] == info["tokenizer_path"] == str(resolve_model_path("tiny-dsa"))
    legacy = httpx.get(dense_server.url + "/get_server_info", headers=HEADERS, timeout=10).json()
    assert legacy["served_model_name"] == info["served_model_name"] and "stats" in legacy
