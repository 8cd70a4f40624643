"""Real processes for the router tests: prefill/decode workers (one launcher) and `decode-server router`.

`WORKER_MODE` is the one switch between the two kinds of workers:
- "colocated": both workers are ordinary `decode-server serve` processes (each runs the whole request; the
  bootstrap fields the router adds are ignored by them). Routing, SSE pass-through, retries, health, metrics and
  disconnect aborts are all testable this way.
- "pd": a real prefill server (with its bootstrap server) and a real decode server (`--disaggregation-mode`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "disagg"))
from api_server_harness import (  # noqa: E402
    CONTEXT_LENGTH,
    REPO,
    ServerProcess,
    free_port,
    pid_alive,
    wait_until_idle,
)
from pd_harness import wait_pd_idle  # noqa: E402

WORKER_MODE = "pd"  # or "colocated": both workers plain `serve` processes
# Fault tests end quickly: decode gives up on a dead prefill peer after 2 missed heartbeats 0.5 s apart.
PD_TIMEOUTS = ["--disaggregation-heartbeat-interval", "0.5", "--disaggregation-heartbeat-max-failures", "2",
               "--disaggregation-bootstrap-timeout", "30", "--disaggregation-waiting-timeout", "120"]
MODEL = "tiny-dsa"
ROUTER_START_TIMEOUT_S = 60.0
ROUTER_PROCESSES = 2  # every test router runs several processes unless a test asks otherwise

__all__ = ["CONTEXT_LENGTH", "MODEL", "REPO", "WORKER_MODE", "RouterProcess", "ServerProcess", "Worker",
           "launch_workers", "pid_alive", "wait_until_idle"]  # fmt: skip


@dataclass
class Worker:
    role: str
    server: ServerProcess
    bootstrap_port: int | None = None

    @property
    def url(self) -> str:
        return self.server.url


def launch_workers(n_prefill: int, n_decode: int) -> tuple[list[Worker], list[Worker]]:
    """Start every worker at once (start-up overlaps), then wait for all of them."""
    prefill, decode = [], []
    for _ in range(n_prefill):
        bootstrap_port = free_port()
        args = [] if WORKER_MODE == "colocated" else [
            "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port), *PD_TIMEOUTS]  # fmt: skip
        prefill.append(Worker("prefill", ServerProcess(*args), bootstrap_port))
    for _ in range(n_decode):
        args = ["--enable-hisparse"]
        if WORKER_MODE == "pd":
            args += ["--disaggregation-mode", "decode", *PD_TIMEOUTS]
        decode.append(Worker("decode", ServerProcess(*args)))
    try:
        for w in prefill + decode:
            w.server.wait_ready()
    except BaseException:
        for w in prefill + decode:
            w.server.kill()
        raise
    return prefill, decode


def child_pids(pid: int) -> list[int]:
    """The direct children of `pid` (from /proc), oldest first."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return sorted(found)


def wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    """The pids still alive after waiting up to `timeout` for them to exit."""
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


class RouterProcess:
    """`python -m decode_server.cli router ...` on a free port, its log in a temporary file.

    `processes` > 1: a supervisor and that many router processes sharing the port. A new connection goes to any
    of them (the kernel's choice), so a test that needs one process's view (its round robin, its health state)
    sends through `self.http`: one keep-alive connection, hence one process, as long as it is not idle for 5 s.
    `stop` checks that no router process is left and that the metrics directory is gone."""

    def __init__(self, prefill: list[Worker], decode: list[Worker], *extra: str,
                 processes: int = ROUTER_PROCESSES) -> None:  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.processes = processes
        self.children: list[int] = []
        self.metrics_dir: str | None = None
        self.http = httpx.Client(base_url=self.url, timeout=60)
        args = [sys.executable, "-m", "decode_server.cli", "router", "--host", "127.0.0.1", "--port", str(self.port),
                "--health-check-interval-secs", "0.5", "--log-level", "info",
                "--router-processes", str(processes)]  # fmt: skip
        for w in prefill:
            args += ["--prefill", w.url, str(w.bootstrap_port)]
        for w in decode:
            args += ["--decode", w.url]
        args += list(extra)
        self.log = tempfile.NamedTemporaryFile("w+", prefix="router-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)

    def log_text(self) -> str:
        return Path(self.log.name).read_text()

    def _record_children(self) -> None:
        """The router processes and their metrics directory, once the supervisor has said it listens."""
        if self.processes == 1 or self.children:
            return
        deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        while f"with {self.processes} router processes" not in self.log_text():
            assert time.monotonic() < deadline and self.proc.poll() is None, self.log_text()
            time.sleep(0.05)
        self.children = child_pids(self.proc.pid)
        assert len(self.children) == self.processes, (self.children, self.log_text())
        environ = Path(f"/proc/{self.children[0]}/environ").read_bytes().split(b"\0")
        self.metrics_dir = next(e.split(b"=", 1)[1].decode() for e in environ
                                if e.startswith(b"PROMETHEUS_MULTIPROC_DIR="))  # fmt: skip

    def wait_ready(self, timeout: float = ROUTER_START_TIMEOUT_S) -> RouterProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self._record_children()
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"router not healthy after {timeout} s:\n{self.log_text()}")

    def wait_started(self, timeout: float = ROUTER_START_TIMEOUT_S) -> RouterProcess:
        """Listening (whatever /health says)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                httpx.get(self.url + "/health", timeout=2)
                self._record_children()
                return self
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"router not listening after {timeout} s:\n{self.log_text()}")

    def health(self) -> httpx.Response:
        """/health of the process behind `self.http`."""
        return self.http.get("/health", timeout=10)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples called `name` whose labels include `labels` (0 when there is none); the whole
        router's value, whichever process answers."""
        text = self.http.get("/metrics", timeout=10).text
        total = 0.0
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total

    def requests_at(self, worker: Worker, outcome: str = "success") -> float:
        return self.metric("hisparse_router:requests_total", role=worker.role, worker=worker.url, outcome=outcome)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Its exit code; raises if it does not exit, leaves a router process behind or its metrics directory."""
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"router did not exit within {timeout} s:\n{self.log_text()}") from None
        left = wait_gone(self.children, 5)
        assert not left, f"router processes {left} outlived the router:\n{self.log_text()}"
        assert self.metrics_dir is None or not os.path.exists(self.metrics_dir), self.metrics_dir
        return code

    def kill(self) -> None:
        """SIGKILL the router and every router process (the supervisor's children included)."""
        self.http.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pid in self.children:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def wait_all_idle(workers: list[Worker], timeout: float = 30.0) -> None:
    """Every pool empty on every worker (PD: no room, staging or aux row left either)."""
    for w in workers:
        if WORKER_MODE == "pd":
            wait_pd_idle(w.server, timeout)
        else:
            wait_until_idle(w.server, timeout)
