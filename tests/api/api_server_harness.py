"""Real servers for the API tests: `decode-server serve` subprocesses on 127.0.0.1, free ports, tiny-dsa on CPU.

Servers run with a short context length so that property-based tests cannot ask for long generations.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import httpx

API_KEY = "test-key"
CONTEXT_LENGTH = 256
START_TIMEOUT_S = 180.0
REPO = Path(__file__).resolve().parents[2]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


# Ports free_port has returned in this process: never returned twice (see free_port).
_HANDED_OUT: set[int] = set()
_PORT_RNG = random.SystemRandom()


def free_port() -> int:
    """A port nothing listens on, below the kernel's ephemeral range, not returned before in this process.

    Why not bind(("127.0.0.1", 0)): that returns an ephemeral port, and between picking it and the server binding
    it the kernel may hand the same number to any outgoing connection — a server's own engine ranks connect to
    each other while it starts — so the server failed with "address already in use" (CI, 2026-11-26). The kernel
    never assigns ports below the ephemeral range by itself: only another explicit bind could take the one picked
    here. Why remember them: a fixture that starts several servers picks every port before any server has bound
    its own, so a second random pick of the same number would still bind here, and one server's health check would
    then be answered by the other (the likely cause of a CI failure on 2026-11-27: `engine_pid in children` failed
    while a fixture started five servers)."""
    low, _ = _ephemeral_range()
    first = 20000 if low > 21000 else 1024
    for _ in range(500):
        port = _PORT_RNG.randrange(first, low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in [{first}, {low}) on 127.0.0.1")


def child_pids(pid: int) -> list[int]:
    """Processes whose parent is `pid` (read from /proc: no psutil needed)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may contain spaces, so split after the last ')'
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry.name))
    return out


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class ServerProcess:
    """`python -m decode_server.cli serve ...` with its log in a temporary file."""

    def __init__(self, *extra_args: str, api_key: str | None = None, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        args = [sys.executable, "-m", "decode_server.cli", "serve", "--model-path", "tiny-dsa", "--device", "cpu",
                "--host", "127.0.0.1", "--port", str(self.port), "--context-length", str(CONTEXT_LENGTH),
                *extra_args]  # fmt: skip
        if api_key:
            args += ["--api-key", api_key]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="decode-server-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=None if env is None else {**os.environ, **env})
        self.engine_pid: int | None = None
        self.children: list[int] = []  # every child seen while running (engine, multiprocessing helpers)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_text(self) -> str:
        return Path(self.log.name).read_text()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} during start-up:\n{self.log_text()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    info = httpx.get(self.url + "/server_info", headers=self.headers, timeout=10).json()
                    self.engine_pid = info["engine_pid"]
                    self.children = child_pids(self.proc.pid)
                    assert self.engine_pid in self.children
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log_text()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send `sig`, wait for the exit; returns the exit code (kills and fails if it hangs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"server did not exit within {timeout} s of {sig!r}:\n{self.log_text()}"
            ) from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pid in self.children:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)

    def stats(self) -> dict:
        return httpx.get(self.url + "/server_info", headers=self.headers, timeout=10).json()["stats"]


def wait_until_idle(server: ServerProcess, timeout: float = 30.0) -> dict:
    """Poll engine stats until no request runs or waits and every KV pool is empty (with prefix caching: holds
    nothing but cached pages that no request maps, see `_idle`); returns the last stats."""
    deadline = time.monotonic() + timeout
    stats: dict = {}
    while time.monotonic() < deadline:
        stats = server.stats()
        if _idle(stats):
            return stats
        time.sleep(0.1)
    raise AssertionError(f"engine not idle after {timeout} s: {stats}")


def _idle(stats: dict) -> bool:
    if stats["num_running_reqs"] or stats["num_queue_reqs"]:
        return False
    pools = {k: stats[k]["used"] for k in ("host_pages", "device_slots", "indexer_slots", "dense_kv_slots")}
    cache = stats.get("prefix_cache")
    if cache is None:
        return not any(pools.values())
    # --enable-prefix-caching: finished requests' full pages stay allocated, owned by the cache. Idle = no request
    # maps any of them (all evictable), and the pools hold nothing else: the dense pool's or the indexer keys' used
    # tokens (HiSparse) are the cached ones, and token usage, which counts unmapped cached pages as free, is 0
    # (that covers the host pool, counted in pages).
    return (cache["evictable_tokens"] == cache["cached_tokens"] and pools["device_slots"] == 0
            and pools["dense_kv_slots"] + pools["indexer_slots"] == cache["cached_tokens"]
            and stats["token_usage"] == 0)


def flush_cache(server: ServerProcess) -> dict:
    """POST /flush_cache (drops the prefix cache's unmapped pages); its JSON answer."""
    r = httpx.post(server.url + "/flush_cache", headers=server.headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def metric_values(server: ServerProcess) -> dict[str, float]:
    """/metrics as {sample name: value} (labelled samples: the last one of each name; use for unlabelled ones)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", headers=server.headers, timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def post_and_disconnect(
    url: str, body: dict, working: Callable[[], bool], headers: dict[str, str] | None = None, timeout: float = 30.0
) -> None:
    """Send a non-streaming POST, wait until `working()` says the server is generating for it, then hang up
    without reading the answer.

    A client timeout would race the generation speed (an idle machine once finished 200 tokens before a 1.5 s
    timeout); this disconnects at a known point of the request instead. Raises if the answer came first."""
    parts = urllib.parse.urlsplit(url)
    payload = json.dumps(body).encode()
    lines = [f"POST {parts.path} HTTP/1.1", f"Host: {parts.netloc}", "Content-Type: application/json",
             f"Content-Length: {len(payload)}", "Connection: close"]  # fmt: skip
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
        deadline = time.monotonic() + timeout
        while not working():
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not start on the request within {timeout} s")
            time.sleep(0.005)
        sock.setblocking(False)
        try:
            answered = sock.recv(1)
        except BlockingIOError:
            answered = b""
        assert not answered, "the server answered before the client hung up"


def assert_no_orphans(server: ServerProcess, timeout: float = 10.0) -> None:
    """Neither the engine process nor any other child of the server outlives it."""
    assert server.engine_pid is not None and server.children
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in server.children):
        time.sleep(0.1)
    left = [p for p in server.children if pid_alive(p)]
    assert not left, f"processes {left} outlived the server (engine pid {server.engine_pid})"


def assert_clean_exit(server: ServerProcess, code: int) -> None:
    """Exit code 0 and no process left behind."""
    assert code == 0, f"exit code {code}:\n{server.log_text()}"
    assert_no_orphans(server)
