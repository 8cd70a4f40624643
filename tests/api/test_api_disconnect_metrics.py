"""Client disconnects and /abort_request free the engine's memory; /metrics exports what it promises."""

from __future__ import annotations

import json
import threading

import httpx
from api_server_harness import ServerProcess, post_and_disconnect, wait_until_idle
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny-dsa"
LONG = {"model": MODEL, "prompt": "Long story:", "max_tokens": 200, "ignore_eos": True, "temperature": 0}


def metrics(server: ServerProcess) -> dict[str, list]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(families: dict[str, list], sample_name: str, **labels: str) -> float:
    for samples in families.values():
        for s in samples:
            if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(sample_name)


def test_stream_disconnect_aborts_and_frees(dense_server: ServerProcess) -> None:
    wait_until_idle(dense_server)
    before = dense_server.stats()["num_generated_tokens"]
    body = dict(LONG, stream=True)
    with httpx.stream("POST", dense_server.url + "/v1/completions", json=body, headers=dense_server.headers,
                      timeout=60) as r:  # fmt: skip
        assert r.status_code == 200
        data_lines = 0
        for line in r.iter_lines():
            data_lines += line.startswith("data: ")
            if data_lines == 3:
                assert dense_server.stats()["num_running_reqs"] == 1
                break  # leaving the line iterator closes the connection mid-stream
    stats = wait_until_idle(dense_server, timeout=20)
    assert stats["num_generated_tokens"] - before < 200, (
        "the request ran to completion instead of being aborted"
    )
    assert value(metrics(dense_server), "sglang:num_requests_total", finish_reason="abort") >= 1


def test_non_streaming_disconnect_aborts_and_frees(dense_server: ServerProcess) -> None:
    wait_until_idle(dense_server)
    before = dense_server.stats()["num_generated_tokens"]
    post_and_disconnect(dense_server.url + "/v1/completions", LONG, headers=dense_server.headers,
                        working=lambda: dense_server.stats()["num_running_reqs"] == 1)  # fmt: skip
    stats = wait_until_idle(dense_server, timeout=20)
    assert stats["num_generated_tokens"] - before < 200


def test_abort_request_route(dense_server: ServerProcess) -> None:
    wait_until_idle(dense_server)
    events: list[dict] = []
    got_id = threading.Event()

    def consume() -> None:
        body = dict(LONG, stream=True)
        with httpx.stream("POST", dense_server.url + "/v1/completions", json=body, headers=dense_server.headers,
                          timeout=60) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: ") :]))
                    got_id.set()

    t = threading.Thread(target=consume)
    t.start()
    assert got_id.wait(30)
    r = httpx.post(
        dense_server.url + "/abort_request", json={"rid": events[0]["id"]}, headers=dense_server.headers
    )
    assert r.json() == {"aborted": 1}
    t.join(30)
    assert not t.is_alive()
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    wait_until_idle(dense_server, timeout=20)


def test_metrics_names_and_values(dense_server: ServerProcess) -> None:
    before = metrics(dense_server)
    r = httpx.post(dense_server.url + "/v1/completions", headers=dense_server.headers, timeout=60,
                   json={"model": MODEL, "prompt": "metrics", "max_tokens": 5, "ignore_eos": True})  # fmt: skip
    assert r.status_code == 200
    after = metrics(dense_server)
    for gauge in ("num_running_reqs", "num_queue_reqs", "token_usage", "gen_throughput"):
        assert f"sglang:{gauge}" in after, gauge
    assert (
        value(after, "sglang:generation_tokens_total") - value(before, "sglang:generation_tokens_total") == 5
    )
    assert value(after, "sglang:prompt_tokens_total") > value(before, "sglang:prompt_tokens_total")
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        count = f"sglang:{hist}_count"
        assert value(after, count, model_name=MODEL) > value(before, count, model_name=MODEL), hist
    assert value(after, "sglang:gen_throughput") > 0
    for name in ("hisparse:swap_in_hits", "hisparse:swap_in_misses", "hisparse:bytes_h2d", "hisparse:bytes_d2h",
                 "hisparse:host_pool_usage", "hisparse:device_buffer_usage", "hisparse:dense_kv_usage"):  # fmt: skip
        assert name in after, name
    assert value(after, "hisparse:dense_kv_total_slots") > 0
    assert value(after, "sglang:engine_alive") == 1.0
