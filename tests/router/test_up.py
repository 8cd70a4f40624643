"""`decode-server up`: starts prefill, decode and router, answers the README example, and stops cleanly with
SIGTERM: exit code 0, no process left behind."""

from __future__ import annotations

import os
import queue
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
from router_harness import CONTEXT_LENGTH, MODEL, REPO, WORKER_MODE, pid_alive

from decode_server.up import free_port

START_TIMEOUT_S = 240.0


def _descendants(pid: int) -> set[int]:
    """Every process below `pid` (children are in their own sessions but still its descendants)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def test_up_serves_the_readme_example_and_stops_cleanly() -> None:
    port = free_port("127.0.0.1")
    args = [sys.executable, "-m", "decode_server.cli", "up", "--device", "cpu", "--port", str(port),
            "--context-length", str(CONTEXT_LENGTH)]  # fmt: skip
    if WORKER_MODE == "colocated":
        args.append("--colocated-workers")
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    log: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    procs: set[int] = set()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert time.monotonic() < deadline, "".join(log)
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert proc.poll() is None, "".join(log)
                continue
            log.append(line)
            if line.startswith("[up] ready"):
                break
        assert f"http://127.0.0.1:{port}/v1" in log[-1]
        for role in ("prefill", "decode", "router"):
            assert any(line.startswith(f"[{role}") for line in log), f"no {role} log line:\n{''.join(log)}"
        procs = _descendants(proc.pid)
        assert len(procs) >= 5, procs  # 3 children + 2 engine processes (at least)

        # The PD control plane is authenticated with a secret `up` generated: a 0600 file all three processes got.
        secret_files = set()
        for p in procs:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
            if "--disaggregation-auth-secret-file" in argv:
                secret_files.add(argv[argv.index("--disaggregation-auth-secret-file") + 1])
        assert len(secret_files) == 1, secret_files
        secret_file = secret_files.pop()
        assert stat.S_IMODE(os.stat(secret_file).st_mode) == 0o600
        assert len(Path(secret_file).read_text()) == 64  # 32 random bytes, hex
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["disaggregation_auth"] == "on"
        if WORKER_MODE == "pd":
            for url in re.findall(r"(?:prefill|decode) (http://[0-9.:]+)", log[-1]):
                info = httpx.get(url + "/server_info", timeout=10).json()
                assert info["disaggregation_auth"] == "on", info

        # The README example.
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused-unless---api-key",
                               max_retries=0, timeout=120)  # fmt: skip
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}],
                                             max_tokens=32, temperature=0)  # fmt: skip
        assert out.choices[0].message.content and out.usage.completion_tokens > 0
        pieces = []
        for chunk in client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=32, stream=True,
                                               stream_options={"include_usage": True}):  # fmt: skip
            pieces.append(chunk.choices[0].text if chunk.choices else chunk.usage)
        assert pieces[-1].completion_tokens == 32

        proc.send_signal(signal.SIGTERM)
        code = proc.wait(90)
        assert code == 0, "".join(log) + "".join(iter_remaining(lines))
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in procs if pid_alive(p)], "processes outlived `up`"
        tail = "".join(iter_remaining(lines))
        assert "[up] stopped: prefill exit code 0, decode exit code 0, router exit code 0" in tail, tail
        assert not os.path.exists(os.path.dirname(secret_file)), "the generated secret outlived `up`"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for p in procs:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)


def iter_remaining(lines: queue.Queue[str]) -> list[str]:
    out = []
    time.sleep(0.2)
    while True:
        try:
            out.append(lines.get_nowait())
        except queue.Empty:
            return out
