"""Several router processes on one port (`--router-processes N`): /metrics counts the requests of every process;
a router process that dies stops the whole router (exit 1, nothing left behind); the supervisor killed takes its
processes with it; a port in use is reported at once. (Every test router runs 2 processes, see `router_harness`;
each `RouterProcess.stop` checks that SIGTERM leaves no process and no metrics directory behind.)"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
from router_harness import MODEL, REPO, RouterProcess, wait_gone

from decode_server.router.config import RouterConfig, default_router_processes
from decode_server.router.supervisor import METRICS_DIR_PREFIX, remove_stale_metrics_dirs

SHORT = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}


def _client_of_another_process(router: RouterProcess, pid: int) -> tuple[httpx.Client, int]:
    """A keep-alive client whose connection the kernel gave to a router process other than `pid`."""
    for _ in range(64):  # each new connection is hashed anew: 2^-64 to miss with two processes
        client = httpx.Client(base_url=router.url, timeout=60)
        other = client.get("/health").json()["router_process"]["pid"]
        if other != pid:
            return client, other
        client.close()
    raise AssertionError(f"every connection went to router process {pid}")


def test_metrics_sum_over_processes(router: RouterProcess) -> None:
    first = router.http.get("/health").json()["router_process"]
    assert first["count"] == 2 and first["pid"] in router.children
    second, other_pid = _client_of_another_process(router, first["pid"])
    route = "/v1/completions"
    try:
        before = router.metric("hisparse_router:client_requests_total", route=route, status="200")
        latency_before = router.metric("hisparse_router:request_latency_seconds_count", route=route)
        for client, n in ((router.http, 3), (second, 2)):
            for _ in range(n):
                assert client.post(route, json=SHORT).status_code == 200
        assert {router.http.get("/health").json()["router_process"]["pid"],
                second.get("/health").json()["router_process"]["pid"]} == {first["pid"], other_pid}  # fmt: skip
        # Whichever process answers /metrics, it reports all five requests.
        for metric in (router.metric, lambda name, **labels: _metric(second, name, **labels)):
            assert metric("hisparse_router:client_requests_total", route=route, status="200") - before == 5
            assert metric("hisparse_router:request_latency_seconds_count", route=route) - latency_before == 5
    finally:
        second.close()
    # Gauges: in flight summed over the processes (0 now), health the minimum over them (1: both see it).
    assert router.metric("hisparse_router:worker_inflight_requests", role="decode") == 0
    text = router.http.get("/metrics").text
    assert 'hisparse_router:worker_healthy{role="decode"' in text and "pid=" not in text


def _metric(client: httpx.Client, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def test_a_router_process_killed_stops_the_router(workers: tuple) -> None:
    prefill, decode = workers
    r = RouterProcess(prefill[:1], decode[:1]).wait_ready()
    try:
        victim, survivor = r.children
        index, other = _index(victim), _index(survivor)
        os.kill(victim, signal.SIGKILL)
        assert r.proc.wait(30) == 1, r.log_text()
        log = r.log_text()
        assert f"router process {index} (pid {victim}) was killed by SIGKILL unexpectedly; stopping the router" \
            in log, log  # fmt: skip
        assert f"router process {other} stopped" in log  # the survivor drained
        assert wait_gone([victim, survivor], 10) == []
        assert r.metrics_dir is not None and not os.path.exists(r.metrics_dir)
    finally:
        r.kill()


def _index(pid: int) -> int:
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return int(args[args.index(b"--index") + 1])


def test_router_processes_die_with_the_supervisor(workers: tuple) -> None:
    prefill, decode = workers
    r = RouterProcess(prefill[:1], decode[:1]).wait_ready()
    try:
        r.proc.kill()  # no chance to stop its children: the parent-death signal must
        r.proc.wait(10)
        assert wait_gone(r.children, 20) == [], r.log_text()
        # The one thing a SIGKILLed supervisor leaves is its metrics directory: the next supervisor removes it.
        assert r.metrics_dir is not None and os.path.isdir(r.metrics_dir)
        assert remove_stale_metrics_dirs(os.path.dirname(r.metrics_dir)) == [r.metrics_dir]
        assert not os.path.exists(r.metrics_dir)
    finally:
        r.kill()
        if r.metrics_dir:
            shutil.rmtree(r.metrics_dir, ignore_errors=True)


def test_stale_metrics_dirs_are_those_of_dead_supervisors(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{METRICS_DIR_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{METRICS_DIR_PREFIX}{os.getpid()}-def"
    other = tmp_path / "something-else-1"
    for d in (stale, live, other):
        d.mkdir()
    (stale / "counter_1.db").write_bytes(b"x")
    assert remove_stale_metrics_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.is_dir() and other.is_dir()


def test_port_in_use_fails_at_once() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "decode_server.cli", "router", "--prefill", "http://127.0.0.1:9",
                              "--decode", "http://127.0.0.1:9", "--port", str(port), "--router-processes", "2"],
                             cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "Address already in use" in out.stderr, out.stderr


def test_default_process_count() -> None:
    config = RouterConfig(prefill=[{"url": "http://127.0.0.1:1"}], decode=[{"url": "http://127.0.0.1:2"}])
    assert config.router_processes == default_router_processes() == min(4, len(os.sched_getaffinity(0)))
