"""`GET /load` (what a router's least_load policy reads) and the optional `rid` body field (the request id a
router sets so that it can abort the request by name)."""

from __future__ import annotations

import threading

import httpx
from api_server_harness import ServerProcess, wait_until_idle

MODEL = "tiny-dsa"
LONG_STREAM = {"model": MODEL, "prompt": "Long story:", "max_tokens": 200, "ignore_eos": True, "temperature": 0,
               "stream": True}  # fmt: skip


def test_load_reports_running_requests_and_pools(dense_server: ServerProcess) -> None:
    wait_until_idle(dense_server)
    idle = httpx.get(dense_server.url + "/load", timeout=10)  # no API key: a probe, like /metrics
    assert idle.status_code == 200
    load = idle.json()
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0
    assert load["dense_kv_slots_free"] == load["dense_kv_slots_total"] > 0
    assert load["host_pages_free"] == load["host_pages_total"] == 0  # dense mode: no host pool
    assert load["token_usage"] == 0.0
    with httpx.stream("POST", dense_server.url + "/v1/completions", json=dict(LONG_STREAM, rid="load-probe-1"),
                      headers=dense_server.headers, timeout=60) as r:  # fmt: skip
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"id":"load-probe-1"' in first
        busy = httpx.get(dense_server.url + "/load", timeout=10).json()
        assert busy["num_running_reqs"] + busy["num_waiting_reqs"] == 1
        assert busy["dense_kv_slots_free"] < busy["dense_kv_slots_total"]
        assert busy["num_inflight_requests"] == 1
    wait_until_idle(dense_server)


def test_rid_names_the_request_and_aborts_it(dense_server: ServerProcess) -> None:
    wait_until_idle(dense_server)
    out = httpx.post(dense_server.url + "/v1/completions", headers=dense_server.headers, timeout=60,
                     json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "rid": "cmpl-router-abc"})  # fmt: skip
    assert out.status_code == 200 and out.json()["id"] == "cmpl-router-abc"

    started = threading.Event()
    result: dict = {}

    def stream() -> None:
        with httpx.stream("POST", dense_server.url + "/v1/completions", json=dict(LONG_STREAM, rid="to-abort"),
                          headers=dense_server.headers, timeout=60) as r:  # fmt: skip
            frames = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    frames.append(line)
                    started.set()
            result["frames"] = frames

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    # The same rid while it runs: refused, naming the parameter.
    dup = httpx.post(dense_server.url + "/v1/completions", headers=dense_server.headers, timeout=60,
                     json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "rid": "to-abort"})  # fmt: skip
    assert dup.status_code == 400 and dup.json()["error"]["param"] == "rid"
    aborted = httpx.post(dense_server.url + "/abort_request", json={"rid": "to-abort"}, headers=dense_server.headers,
                         timeout=10)  # fmt: skip
    assert aborted.json() == {"aborted": 1}
    t.join(60)
    assert '"finish_reason":"abort"' in "".join(result["frames"])
    wait_until_idle(dense_server)

    bad = httpx.post(dense_server.url + "/v1/completions", headers=dense_server.headers, timeout=60,
                     json={"model": MODEL, "prompt": "Hi", "rid": "has spaces/slashes"})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "rid"
