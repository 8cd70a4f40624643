"""Several router processes on one port (`--router-processes N`, N > 1): the supervisor.

Why: one router process costs about 1.3 ms of CPU per request and ~53 µs per relayed chunk on one core
(`docs/benchmarks.md`), so a burst of 64 simultaneous streams queues behind that one core. N processes, each with
its own event loop, connection pool, health/load checks and policy state, share the work.

How the port is shared: the supervisor creates N listening sockets itself, each with SO_REUSEPORT and bound to the
same address, and hands one to each child as an inherited file descriptor. Why not the alternatives (on Linux):
- one socket inherited by every child (uvicorn `--workers`, gunicorn): all children wait on the same accept queue,
  every new connection wakes every child's event loop, and the loop that wins accepts in a loop while connections
  are queued (asyncio takes up to `backlog` per wake-up, libuv/uvloop until EAGAIN), so how a burst is spread
  depends on which loops happen to be awake: `benchmarks/bench_accept_spread.py` put 19 to 56 of 64 connections
  on the busiest of 4 processes (10 runs, 2-core VM). With SO_REUSEPORT the kernel hashes each connection's
  addresses and ports to one of the N sockets: the spread does not depend on timing (busiest process 18 to 25 of
  64 in the same runs) and no process is woken for another's connection;
- each child binding SO_REUSEPORT itself: a bind error (port in use, bad host) would surface N times, late, in
  the children; port 0 (any free port) would give each child a different port; and until the last child has bound,
  only some of them would serve the port. Bound here, the port is known and its errors reported before any child
  starts, and every socket listens from the start: a connection that arrives before its child runs waits in that
  socket's backlog;
- the supervisor closes its copy of each socket as soon as the child has it, so a socket lives and dies with its
  child: the kernel never hashes a connection to a socket nobody accepts on (a copy left open here would keep a
  dead child's share of new connections hanging).
Linux admits to a SO_REUSEPORT group only sockets of the same effective user, so another user cannot take a share
of the port. SO_REUSEPORT does not look at load: a connection goes to its process whether or not that one is busy,
and a keep-alive connection stays with its process (a client that reuses one connection uses one process).

Children are fresh interpreters (`python -m decode_server.router.child`), not forks: nothing of the supervisor is
copied into them, and prometheus_client must see PROMETHEUS_MULTIPROC_DIR when it is first imported. The config
goes in the environment (not argv, where `ps` would show the API key); the socket and a readiness pipe are
inherited descriptors.

Supervision:
- start: each child reports on its pipe once it accepts connections (after its first round of health checks);
  all must within `START_TIMEOUT_S`, otherwise everything is stopped and the exit code is 1;
- SIGTERM or SIGINT: forwarded as SIGTERM to every child, which drains as the single-process router does; a second
  signal is forwarded again (the children then force their exit); exit code 0 when every child exits with 0; a
  child still running `STOP_TIMEOUT_S` after the first signal is killed;
- a child that exits on its own (crash, OOM killer, kill -9): logged with its index, pid and exit status, the others
  are stopped (SIGTERM, drain) and the supervisor exits with 1. It does not restart the child: a router that
  quietly runs on fewer processes than configured has less capacity than its operator thinks, and a restart loop
  would bury the cause in the log; whatever runs the router (systemd, Kubernetes, `decode-server up`) restarts it
  whole, with clean state;
- the supervisor killed with SIGKILL: every child has the parent-death signal SIGTERM, so it drains and exits too;
  only the metrics directory is left behind in the temporary directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from types import FrameType

from prometheus_client import multiprocess

# Not the server module: the supervisor itself needs neither FastAPI nor aiohttp (it starts faster without).
from decode_server.router.config import ABORT_DRAIN_S, GRACEFUL_SHUTDOWN_S, RouterConfig

logger = logging.getLogger("decode_server.router")

CONFIG_ENV = "HISPARSE_ROUTER_CONFIG"
BACKLOG = 4096  # per socket, as the single-process router's uvicorn
START_TIMEOUT_S = 60.0  # imports + first health checks, on a busy machine
STOP_TIMEOUT_S = GRACEFUL_SHUTDOWN_S + ABORT_DRAIN_S + 5.0  # a child's drain, and then some
POLL_S = 0.05
READY = b"R"


METRICS_DIR_PREFIX = "hisparse-router-metrics-"


def remove_stale_metrics_dirs(root: str | None = None) -> list[str]:
    """Remove metrics directories left by supervisors that are gone.

    A supervisor removes its directory when it exits, but one killed with SIGKILL cannot. Each directory is named
    after its supervisor's pid, so a new supervisor deletes those whose pid no longer exists. A reused pid keeps its
    directory, which is harmless. Returns the removed paths."""
    root = root or tempfile.gettempdir()
    removed: list[str] = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        pid_text = name[len(METRICS_DIR_PREFIX):].split("-", 1)[0]
        if not name.startswith(METRICS_DIR_PREFIX) or not pid_text.isdigit():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            path = os.path.join(root, name)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        except PermissionError:
            pass  # another user's live process
    return removed


@dataclass
class _Child:
    index: int
    proc: subprocess.Popen[bytes]
    ready_fd: int | None  # read end of the readiness pipe, until read
    reaped: bool = False  # exit seen (and its live gauges dropped)

    def describe_exit(self) -> str:
        code = self.proc.returncode
        if code is not None and code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"


def listening_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets listening on one address with SO_REUSEPORT (port 0: one free port chosen for all)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]  # fmt: skip
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(address)
            address = (address[0], sock.getsockname()[1], *address[2:])  # the port the first bind got
            sock.listen(BACKLOG)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class Supervisor:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.children: list[_Child] = []
        self.metrics_dir = ""
        self.signals = 0  # stop signals received (the handler only counts; the loops act on it)
        self.sent = 0  # SIGTERMs sent to the children

    # -------------------------------------------------------------------------------------- entry

    def run(self) -> int:
        n = self.config.router_processes
        try:
            sockets = listening_sockets(self.config.host, self.config.port, n)
        except OSError as exc:
            logger.error("cannot listen on %s:%d: %s", self.config.host, self.config.port, exc)
            return 1
        port = sockets[0].getsockname()[1]
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        remove_stale_metrics_dirs()
        self.metrics_dir = tempfile.mkdtemp(prefix=f"{METRICS_DIR_PREFIX}{os.getpid()}-")
        try:
            config_json = self.config.model_copy(update={"port": port}).model_dump_json()
            for index, sock in enumerate(sockets):
                self.children.append(self._start_child(index, sock, config_json))
                sock.close()  # the child's now: it must not outlive the child here (see the module docstring)
            failure = self._wait_ready()
            if failure is None:
                logger.info("listening on %s://%s:%d (OpenAI API under /v1) with %d router processes (pids %s)",
                            "https" if self.config.ssl_certfile else "http", self.config.host, port, n,
                            ", ".join(str(c.proc.pid) for c in self.children))  # fmt: skip
                return self._supervise()
            if failure:
                logger.error("router start failed: %s", failure)
            return self._stop(1 if failure else 0)
        finally:
            for sock in sockets:
                sock.close()
            for child in self.children:  # nothing may outlive the supervisor
                if child.proc.poll() is None:
                    child.proc.kill()
                    child.proc.wait()
                self._reap(child)
                if child.ready_fd is not None:
                    os.close(child.ready_fd)
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    # -------------------------------------------------------------------------------------- children

    def _start_child(self, index: int, sock: socket.socket, config_json: str) -> _Child:
        ready_r, ready_w = os.pipe()
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=self.metrics_dir, **{CONFIG_ENV: config_json})
        env.pop("prometheus_multiproc_dir", None)  # the old spelling would win in some prometheus_client versions
        cmd = [sys.executable, "-m", "decode_server.router.child", "--index", str(index), "--listen-fd",
               str(sock.fileno()), "--ready-fd", str(ready_w), "--parent-pid", str(os.getpid())]  # fmt: skip
        try:
            proc = subprocess.Popen(cmd, env=env, pass_fds=(sock.fileno(), ready_w))
        except BaseException:
            os.close(ready_r)
            raise
        finally:
            os.close(ready_w)
        return _Child(index, proc, ready_r)

    def _reap(self, child: _Child) -> None:
        """A child has exited: its `live*` gauges (health, in-flight, load) no longer count in /metrics."""
        if not child.reaped:
            child.reaped = True
            multiprocess.mark_process_dead(child.proc.pid, self.metrics_dir)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals += 1

    def _send_stops(self) -> None:
        """One SIGTERM to every running child per stop signal received, and at least one: the first starts each
        child's drain, a second forces its exit (as for the single-process router)."""
        while self.sent < max(1, self.signals):
            self.sent += 1
            if self.signals:
                logger.info("stop signal received: stopping %d router processes", len(self.children))
            for child in self.children:
                if child.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        child.proc.send_signal(signal.SIGTERM)

    def _exited(self) -> list[_Child]:
        return [c for c in self.children if c.proc.poll() is not None]

    # -------------------------------------------------------------------------------------- phases

    def _wait_ready(self) -> str | None:
        """None once every child accepts connections; "" if a stop signal came first; otherwise what failed."""
        deadline = time.monotonic() + START_TIMEOUT_S + self.config.health_check_timeout_secs
        pending = {c.ready_fd: c for c in self.children if c.ready_fd is not None}
        while pending:
            if self.signals:
                return ""
            for child in self._exited():
                return f"router process {child.index} (pid {child.proc.pid}) {child.describe_exit()} during start-up"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return f"router processes {sorted(c.index for c in pending.values())} not ready after " \
                       f"{START_TIMEOUT_S + self.config.health_check_timeout_secs:g} s"  # fmt: skip
            readable, _, _ = select.select(list(pending), [], [], min(remaining, POLL_S * 4))
            for fd in readable:
                child = pending.pop(fd)
                data = os.read(fd, 1)
                os.close(fd)
                child.ready_fd = None
                if data != READY:  # closed without a word: the child is on its way out
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        child.proc.wait(STOP_TIMEOUT_S)
                    return f"router process {child.index} (pid {child.proc.pid}) {child.describe_exit()} " \
                           "during start-up"  # fmt: skip
        return None

    def _supervise(self) -> int:
        """Until a stop signal (then drain: 0) or a child's own exit (then stop the others: 1)."""
        while True:
            if self.signals:
                return self._stop(0)
            exited = self._exited()
            if exited:
                for child in exited:
                    self._reap(child)
                    logger.error("router process %d (pid %d) %s unexpectedly; stopping the router", child.index,
                                 child.proc.pid, child.describe_exit())  # fmt: skip
                return self._stop(1)
            time.sleep(POLL_S)

    def _stop(self, code: int) -> int:
        """SIGTERM to every child (and again on each further signal), wait for their drain, kill what is left;
        `code` 1 (a failure already) stays 1, 0 becomes 1 if a child fails to stop cleanly."""
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while True:
            self._send_stops()
            for child in self._exited():
                self._reap(child)
            running = [c for c in self.children if c.proc.returncode is None]
            if not running:
                break
            if time.monotonic() > deadline:
                for child in running:
                    logger.error("router process %d (pid %d) did not stop within %g s; killing it", child.index,
                                 child.proc.pid, STOP_TIMEOUT_S)  # fmt: skip
                    child.proc.kill()
                    child.proc.wait()
                return 1
            time.sleep(POLL_S)
        if code == 0:
            for child in self.children:
                if child.proc.returncode != 0:
                    logger.error("router process %d (pid %d) %s while stopping", child.index, child.proc.pid,
                                 child.describe_exit())  # fmt: skip
                    code = 1
        logger.info("router stopped" if code == 0 else "router stopped after a failure")
        return code


def run_supervised(config: RouterConfig) -> int:
    """`decode-server router --router-processes N` (N > 1)."""
    return Supervisor(config).run()
