"""`decode-server up`: a whole local PD deployment with one command (also `make serve-pd`).

One prefill server (with its bootstrap server), one decode server (HiSparse on) and one router, each a child
process in its own process group, on free ports unless given. Their logs are printed with a role prefix. It
waits until the router reports both workers healthy, prints the URL, and on Ctrl-C or SIGTERM stops the router
first, then both servers (each stops its own engine process), and kills any process group member left after
the grace period: nothing outlives it. Should `up` itself be killed with SIGKILL, Linux's parent-death signal
still sends SIGTERM to every child.

The PD control plane is always authenticated: unless `--disaggregation-auth-secret-file` names one, `up` writes a
fresh secret (`secrets.token_bytes`, hex) into a 0600 file in a private temporary directory, gives it to all three
processes, and removes it when it stops.

This module only starts processes: it imports neither the engine nor torch.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import get_args

import httpx

from decode_server import config as server_config
from decode_server.router.config import Policy

STOP_GRACE_S = 20.0
POLL_S = 0.25
_PR_SET_PDEATHSIG = 1


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def pd_roles_available() -> bool:
    """True when this build's `serve` has the PD roles (`--disaggregation-mode`)."""
    return hasattr(server_config, "DisaggregationConfig")


def add_up_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("deployment")
    g.add_argument("--model-path", default="tiny-dsa", help="'tiny-dsa' (embedded default) or a checkpoint")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    g.add_argument("--host", default="127.0.0.1", help="every process listens here")
    g.add_argument("--port", type=int, default=30000, help="the router's port: the URL clients use")
    g.add_argument("--prefill-port", type=int, default=0, help="0: a free port")
    g.add_argument("--decode-port", type=int, default=0, help="0: a free port")
    g.add_argument("--bootstrap-port", type=int, default=0, help="prefill's bootstrap server; 0: a free port")
    g.add_argument("--policy", choices=list(get_args(Policy)), default="round_robin")
    g.add_argument("--api-key", default=None, help="required by the router and both servers")
    g.add_argument("--disaggregation-auth-secret-file", default=None, metavar="PATH",
                   help="the PD secret shared by the three processes; default: a fresh one in a 0600 temporary "
                   "file, removed on exit")
    g.add_argument("--context-length", type=int, default=None)
    g.add_argument("--hisparse-config", default=None, metavar="JSON", help="decode server's HiSparse settings")
    g.add_argument("--transfer-backend", default="mooncake", choices=["mooncake"])
    g.add_argument("--colocated-workers", action="store_true",
                   help="run both workers as colocated servers (no KV transfer; each runs the whole request): "
                   "to try the router without the PD roles")  # fmt: skip
    g.add_argument("--prefill-args", default="", metavar="ARGS", help="extra flags of the prefill server")
    g.add_argument("--decode-args", default="", metavar="ARGS", help="extra flags of the decode server")
    g.add_argument("--router-args", default="", metavar="ARGS", help="extra flags of the router")
    g.add_argument("--start-timeout-secs", type=float, default=600.0)
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


@dataclass
class Child:
    role: str
    args: list[str]
    url: str
    proc: subprocess.Popen[bytes] | None = None
    pgid: int | None = None
    pumps: list[threading.Thread] = field(default_factory=list)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _set_pdeathsig() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux only; elsewhere a no-op)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Deployment:
    def __init__(self, children: list[Child], out: Callable[[str], None]) -> None:
        self.children = children
        self.out = out
        self._lock = threading.Lock()

    def _pump(self, child: Child) -> None:
        assert child.proc is not None and child.proc.stdout is not None
        width = max(len(c.role) for c in self.children)
        for raw in iter(child.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self._lock:
                self.out(f"[{child.role:<{width}}] {line}")

    def start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # Every fork before any thread starts: preexec_fn is only safe in a single-threaded parent.
        for child in self.children:
            child.proc = subprocess.Popen(  # noqa: S603
                child.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_set_pdeathsig, env=env,
            )  # fmt: skip
            child.pgid = child.proc.pid  # a new session: its leader's pid is the group id
        for child in self.children:
            pump = threading.Thread(target=self._pump, args=(child,), name=f"log-{child.role}", daemon=True)
            pump.start()
            child.pumps.append(pump)

    def first_exited(self) -> Child | None:
        return next((c for c in self.children if c.proc is not None and c.proc.poll() is not None), None)

    def wait_healthy(self, timeout: float, stop: threading.Event) -> str | None:
        """None once every child answers /health with 200; otherwise why not."""
        deadline = time.monotonic() + timeout
        pending = list(self.children)
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while pending:
                if stop.is_set():
                    return "stopped while starting"
                exited = self.first_exited()
                if exited is not None:
                    return f"the {exited.role} process exited with code {exited.proc.returncode} during start-up"  # type: ignore[union-attr]
                if time.monotonic() > deadline:
                    return f"not healthy after {timeout:g} s: {', '.join(c.role for c in pending)}"
                for child in list(pending):
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(child.url + "/health").status_code == 200:
                            pending.remove(child)
                if pending:
                    stop.wait(POLL_S)
        return None

    def stop(self) -> list[int | None]:
        """Router first (no new requests), then the servers; SIGKILL whatever is left of each process group."""
        router = [c for c in self.children if c.role == "router"]
        workers = [c for c in self.children if c.role != "router"]
        for group in (router, workers):
            for child in group:
                if child.alive():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child.proc.pid, signal.SIGTERM)  # type: ignore[union-attr]
            deadline = time.monotonic() + STOP_GRACE_S
            for child in group:
                if child.proc is None:
                    continue
                try:
                    child.proc.wait(max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    self.out(f"[up] {child.role} did not stop within {STOP_GRACE_S:g} s; killing it")
        for child in self.children:
            if child.pgid is not None:
                # Anything left in the group (an engine whose server was killed): no orphans.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.pgid, signal.SIGKILL)
            if child.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(5)
        for child in self.children:
            for pump in child.pumps:
                pump.join(2)
        return [c.proc.returncode if c.proc is not None else None for c in self.children]


def plan(args: argparse.Namespace) -> list[Child]:
    """The three command lines (servers through this interpreter's `decode_server.cli`)."""
    host = args.host
    prefill_port = args.prefill_port or free_port(host)
    decode_port = args.decode_port or free_port(host)
    bootstrap_port = args.bootstrap_port or free_port(host)
    cli = [sys.executable, "-m", "decode_server.cli"]
    common = ["--model-path", args.model_path, "--device", args.device, "--host", host,
              "--log-level", args.log_level]  # fmt: skip
    if args.context_length:
        common += ["--context-length", str(args.context_length)]
    if args.api_key:
        common += ["--api-key", args.api_key]
    secret = ["--disaggregation-auth-secret-file", args.disaggregation_auth_secret_file] \
        if args.disaggregation_auth_secret_file else []  # fmt: skip
    common += secret
    prefill = [*cli, "serve", *common, "--port", str(prefill_port)]
    decode = [*cli, "serve", *common, "--port", str(decode_port), "--enable-hisparse"]
    if args.hisparse_config:
        decode += ["--hisparse-config", args.hisparse_config]
    if not args.colocated_workers:
        pd = ["--disaggregation-transfer-backend", args.transfer_backend]
        prefill += ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port), *pd]
        decode += ["--disaggregation-mode", "decode", *pd]
    prefill += shlex.split(args.prefill_args)
    decode += shlex.split(args.decode_args)
    prefill_url, decode_url = f"http://{host}:{prefill_port}", f"http://{host}:{decode_port}"
    router = [*cli, "router", "--prefill", prefill_url, str(bootstrap_port), "--decode", decode_url,
              "--host", host, "--port", str(args.port), "--policy", args.policy, "--log-level", args.log_level,
              "--health-check-interval-secs", "1",
              # One local user: one router process is plenty (`--router-args "--router-processes 4"` for more).
              "--router-processes", "1"]  # fmt: skip
    if args.api_key:
        router += ["--api-key", args.api_key, "--worker-api-key", args.api_key]
    router += secret
    router += shlex.split(args.router_args)
    return [
        Child("prefill", prefill, prefill_url),
        Child("decode", decode, decode_url),
        Child("router", router, f"http://{host}:{args.port}"),
    ]


def write_secret_file() -> str:
    """A fresh 32-byte secret (hex) in a 0600 file inside a new 0700 temporary directory; returns the file."""
    directory = tempfile.mkdtemp(prefix="hisparse-up-")  # 0700, ours
    path = os.path.join(directory, "pd-auth-secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_bytes(32).hex())
    return path


def run_up(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not args.colocated_workers and not pd_roles_available():
        parser.error("this build's servers have no PD roles (--disaggregation-mode); use --colocated-workers")
    if args.port == 0:
        args.port = free_port(args.host)
    generated = None
    if not args.disaggregation_auth_secret_file:
        generated = args.disaggregation_auth_secret_file = write_secret_file()
    try:
        return _run(args)
    finally:
        if generated is not None:
            shutil.rmtree(os.path.dirname(generated), ignore_errors=True)


def _run(args: argparse.Namespace) -> int:
    def out(line: str) -> None:
        print(line, flush=True)

    deployment = Deployment(plan(args), out)
    stop = threading.Event()
    received: list[int] = []

    def on_signal(sig: int, _frame: object) -> None:
        if stop.is_set():
            return
        received.append(sig)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        deployment.start()
        problem = deployment.wait_healthy(args.start_timeout_secs, stop)
        if problem is not None and not received:
            out(f"[up] could not start: {problem}")
            code = 1
        elif problem is None:
            router = deployment.children[-1]
            mode = "colocated workers" if args.colocated_workers else "prefill/decode disaggregated"
            out(f"[up] ready ({mode}): {router.url}/v1  (prefill {deployment.children[0].url}, "
                f"decode {deployment.children[1].url}); Ctrl-C stops everything")  # fmt: skip
            while not stop.is_set():
                exited = deployment.first_exited()
                if exited is not None:
                    out(f"[up] the {exited.role} process exited with code {exited.proc.returncode}; "  # type: ignore[union-attr]
                        "stopping the deployment")  # fmt: skip
                    code = 1
                    break
                stop.wait(POLL_S)
    finally:
        if received:
            out(f"[up] {signal.Signals(received[0]).name} received: stopping router, decode, prefill")
        codes = deployment.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    roles = [c.role for c in deployment.children]
    out("[up] stopped: " + ", ".join(f"{r} exit code {c}" for r, c in zip(roles, codes, strict=True)))
    if code == 0 and any(c not in (0, None) for c in codes):
        code = 1
    return code
