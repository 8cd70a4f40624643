"""Build the CPU image and run `decode-server serve` in it, where a container engine works (docker or podman on
PATH and answering); skipped with the reason otherwise (CI has no engine: the wheel tests cover the install).
Not marked slow, so that `make test` shows why it skipped; with an engine it downloads the CPU torch wheel."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid

import httpx
import pytest
from deploy_checks import REPO


def _engine() -> tuple[str | None, str]:
    reasons = []
    for name in ("docker", "podman"):
        path = shutil.which(name)
        if not path:
            reasons.append(f"{name}: not on PATH")
            continue
        probe = subprocess.run([path, "info"], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            return path, ""
        last = (probe.stderr or probe.stdout).strip().splitlines()
        reasons.append(f"{name}: `{name} info` failed ({last[-1] if last else probe.returncode})")
    return None, "; ".join(reasons)


def test_cpu_image_serves_the_embedded_model() -> None:
    engine, why = _engine()
    if engine is None:
        pytest.skip(f"no working container engine: {why}")
    tag = f"hisparse-decode-server:test-{uuid.uuid4().hex[:8]}"
    name = f"hisparse-test-{uuid.uuid4().hex[:8]}"
    subprocess.run([engine, "build", "--target", "cpu", "-t", tag, str(REPO)], check=True, timeout=3600)
    try:
        subprocess.run([engine, "run", "-d", "--rm", "--name", name, "--read-only", "--tmpfs", "/tmp",
                        "--tmpfs", "/var/cache/hisparse", "--cap-drop", "ALL", "-p", "127.0.0.1::30000", tag],
                       check=True, timeout=120)  # fmt: skip
        port = subprocess.check_output([engine, "port", name, "30000/tcp"], text=True).strip().rsplit(":", 1)[1]
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        body = {"model": "tiny-dsa", "prompt": "hello", "max_tokens": 4}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        user = subprocess.check_output([engine, "exec", name, "id", "-u"], text=True).strip()
        assert user == "10001"
    finally:
        subprocess.run([engine, "rm", "-f", name], capture_output=True, timeout=60)
        subprocess.run([engine, "rmi", "-f", tag], capture_output=True, timeout=120)
