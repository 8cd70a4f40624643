"""The CPU image built and run for real: `make test-image` (marked `image`; CI runs it after `make test`).

The image is built with BuildKit from a base made of Debian's packages and no registry (tests/deploy/
container_engine.py says how the engine, base and pip settings are obtained); then:
- every shared library the image's wheels link resolves, and the PD roles import mooncake, as uid 10001;
- the image's default command serves under the hardened run docs/deploy.md shows (read-only, tmpfs, no caps);
- deploy/compose/compose.yaml as shipped (prefill + decode + router) comes up healthy, serves a chat
  completion through the router with the openai client, the prompt's KV crossing from the prefill to the
  decode container through the transfer engine, and `docker compose down` leaves nothing behind.

Skips only where no container engine can run (no engine answers, and starting one needs root)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import container_engine
import httpx
import openai
import pytest
from container_engine import Engine
from deploy_checks import REPO

pytestmark = [pytest.mark.image, pytest.mark.timeout(3600)]
logger = logging.getLogger(__name__)

IMAGE = "hisparse-decode-server:cpu"  # the tag deploy/compose/compose.yaml runs
COMPOSE = REPO / "deploy" / "compose" / "compose.yaml"
DEPLOY_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with contextlib.ExitStack() as stack:
        try:
            found = stack.enter_context(container_engine.engine_session())
        except container_engine.Unavailable as exc:
            pytest.skip(f"no container engine can run here: {exc}")
        yield found


@pytest.fixture(scope="module")
def image(engine: Engine) -> str:
    """`docker build --target cpu` of the repository, with the base and pip settings of this machine."""
    config = container_engine.pip_config()
    started = time.monotonic()
    base = container_engine.base_image(engine, config)
    base_s = time.monotonic() - started
    args = {"CPU_BASE_IMAGE": base, **container_engine.pip_build_args(config)}
    wheel = container_engine.local_cpu_torch_wheel(config, container_engine.torch_version(REPO / "Dockerfile"))
    with contextlib.ExitStack() as stack:
        if wheel is not None:
            served = container_engine.serve_wheel(wheel, port_file=container_engine.CACHE / "wheel-port")
            args["TORCH_FIND_LINKS"] = stack.enter_context(served)
            logger.info("torch from %s", wheel)
        build_args = [a for k, v in args.items() for a in ("--build-arg", f"{k}={v}")]
        progress = ["--progress", "plain"] if engine.buildkit else []
        started = time.monotonic()
        built = engine.run("build", "--network", "host", *progress, "--target", "cpu", *build_args, "-t", IMAGE,
                           str(REPO), timeout=3000, check=False)  # fmt: skip
    build_s = time.monotonic() - started
    log = container_engine.CACHE / "build.log"
    log.write_text(built.stdout + built.stderr)
    assert built.returncode == 0, f"docker build failed (whole log: {log}):\n{built.stderr[-6000:]}"
    cached = len(re.findall(r"^#\d+ CACHED$", built.stderr, re.MULTILINE))
    logger.info("base %.0f s, image build %.0f s (%d steps cached; log in %s)", base_s, build_s, cached, log)
    # The previous build's layers, now untagged, and build cache beyond a few GB.
    engine.run("image", "prune", "-f", check=False)
    if engine.buildkit:
        engine.run("builder", "prune", "-f", "--keep-storage", "4GB", check=False)
    return IMAGE


def test_every_linked_library_resolves_and_pd_roles_import_mooncake(engine: Engine, image: str) -> None:
    out = engine.run("run", "--rm", "--network", "none", "--entrypoint", "python", image,
                     "-m", "decode_server.ops", "check-libs", check=False)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every library linked by" in out.stderr
    script = "import os, mooncake.engine, transfer.mooncake_transport; print(os.getuid())"
    out = engine.run("run", "--rm", "--network", "none", "--entrypoint", "python", image, "-c", script)
    assert out.stdout.strip() == "10001"


def test_torch_is_the_cpu_build(engine: Engine, image: str) -> None:
    script = "import torch; print(torch.__version__, torch.version.cuda)"
    out = engine.run("run", "--rm", "--network", "none", "--entrypoint", "python", image, "-c", script)
    version, cuda = out.stdout.split()
    assert version.endswith("+cpu") and cuda == "None", out.stdout


def test_hardened_container_serves_the_default_command(engine: Engine, image: str) -> None:
    """docs/deploy.md's `docker run`, read-only with tmpfs for /tmp and the cache (owned by uid 10001)."""
    name = f"hisparse-test-{secrets.token_hex(4)}"
    port = _free_port()
    # A network of its own: a published port needs one (an engine may have no default bridge, as ours has not).
    engine.run("network", "create", name)
    try:
        engine.run("run", "-d", "--name", name, "--network", name, "--read-only", "--tmpfs", "/tmp",
                   "--tmpfs", "/var/cache/hisparse:uid=10001,gid=10001,exec", "--cap-drop", "ALL",
                   "--security-opt", "no-new-privileges:true", "-p", f"127.0.0.1:{port}:30000", image)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            running = engine.run("inspect", "-f", "{{.State.Running}}", name, check=False).stdout.strip()
            assert running == "true", engine.run("logs", name, check=False).stderr[-4000:]
            assert time.monotonic() < deadline, "no healthy answer on the published port in 300 s"
            time.sleep(1)
        body = {"model": "tiny-dsa", "prompt": "hello", "max_tokens": 4}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4, reply.text
        assert engine.run("exec", name, "id", "-u").stdout.strip() == "10001"
        probe = engine.run("exec", name, "python", "-m", "decode_server.ops", "probe", check=False)
        assert probe.returncode == 0, probe.stderr  # the image's HEALTHCHECK command
    finally:
        engine.run("rm", "-f", name, check=False)
        engine.run("network", "rm", name, check=False)


@dataclass
class Deployment:
    project: str
    files: list[str]
    router: str
    api_key: str


@pytest.fixture
def deployment(engine: Engine, image: str, tmp_path: Path) -> Iterator[Deployment]:
    project = f"hisparse-test-{secrets.token_hex(3)}"
    files = ["-f", str(COMPOSE)]
    override = container_engine.memlock_override(engine, image, COMPOSE, tmp_path)
    if override is not None:
        files += ["-f", str(override)]
    port = _free_port()
    api_key = secrets.token_hex(16)
    # compose.yaml's PD secret (issue 25) is a file, made as its header tells users: 0400, owned by the image's
    # user (uid 10001), whose path is exported. Root here (the test runs its own dockerd); elsewhere 0444.
    secret_file = tmp_path / "pd_auth.secret"
    secret_file.write_text(secrets.token_hex(32))
    try:
        os.chown(secret_file, 10001, 10001)
        secret_file.chmod(0o400)
    except PermissionError:
        secret_file.chmod(0o444)
    engine.env.update(DECODE_SERVER_API_KEY=api_key, ROUTER_PORT=str(port),
                      HISPARSE_PD_AUTH_SECRET_FILE=str(secret_file))
    try:
        started = time.monotonic()
        up = engine.compose(*files, "-p", project, "up", "-d", "--no-build", "--wait",
                            "--wait-timeout", str(DEPLOY_TIMEOUT_S), check=False, timeout=DEPLOY_TIMEOUT_S + 60)
        if up.returncode != 0:
            logs = engine.compose(*files, "-p", project, "logs", "--no-color", "--tail", "40", check=False)
            raise AssertionError(f"compose up failed:\n{up.stderr[-3000:]}\n{logs.stdout[-6000:]}")
        logger.info("compose up (all healthy) in %.0f s", time.monotonic() - started)
        yield Deployment(project, files, f"http://127.0.0.1:{port}", api_key)
    finally:
        engine.compose(*files, "-p", project, "down", "--timeout", "60", check=False, timeout=300)
        for key in ("DECODE_SERVER_API_KEY", "ROUTER_PORT", "HISPARSE_PD_AUTH_SECRET_FILE"):
            engine.env.pop(key, None)


def _metrics(engine: Engine, d: Deployment, service: str) -> dict[str, float]:
    """A worker's /metrics, read from inside its container (compose publishes only the router)."""
    script = ("import sys, urllib.request; "
              "sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:30000/metrics').read().decode())")  # fmt: skip
    text = engine.compose(*d.files, "-p", d.project, "exec", "-T", service, "python", "-c", script).stdout
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def _sample(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for key, value in samples.items():
        if key.split("{", 1)[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += value
    return total


def test_compose_deployment_serves_through_the_router(engine: Engine, deployment: Deployment) -> None:
    d = deployment
    ps = engine.compose(*d.files, "-p", d.project, "ps", "--format", "{{.Service}} {{.State}} {{.Health}}").stdout
    health = {line.split()[0]: line.split()[1:] for line in ps.splitlines() if line.strip()}
    assert health == {s: ["running", "healthy"] for s in ("prefill", "decode", "router")}, ps

    # The router's own API-key check, then a chat completion with the openai client.
    assert httpx.get(d.router + "/v1/models", timeout=30).status_code == 401
    client = openai.OpenAI(base_url=d.router + "/v1", api_key=d.api_key, max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="tiny-dsa", max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "Say hello"}])  # fmt: skip
    assert reply.usage.completion_tokens == 8 and reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens > 0

    # The prompt's KV went from the prefill container to the decode container through the transfer engine.
    decode, prefill = _metrics(engine, d, "decode"), _metrics(engine, d, "prefill")
    assert _sample(decode, "sglang:kv_transfer_rooms_finished_total", state="success") >= 1, decode
    assert _sample(decode, "sglang:kv_transfer_bytes_total") > 0
    assert _sample(decode, "sglang:num_transfer_failed_reqs_total") == 0
    assert _sample(prefill, "sglang:kv_transfer_rooms_finished_total", state="success") >= 1, prefill
    # ... over the authenticated control plane (the compose secret reached every server), with nothing refused.
    for samples in (decode, prefill):
        assert _sample(samples, "sglang:kv_transfer_auth_enabled") == 1
        assert _sample(samples, "sglang:kv_transfer_rejected_messages_total") == 0

    # Stop drains and exits cleanly; down removes every container and the project network.
    engine.compose(*d.files, "-p", d.project, "stop", timeout=300)
    ps = engine.compose(*d.files, "-p", d.project, "ps", "-a", "--format", "{{.Service}} {{.ExitCode}}").stdout
    assert sorted(ps.split()) == sorted(["decode", "0", "prefill", "0", "router", "0"]), ps
    engine.compose(*d.files, "-p", d.project, "down", timeout=300)
    label = f"label=com.docker.compose.project={d.project}"
    assert engine.run("ps", "-a", "-q", "--filter", label).stdout.strip() == ""
    assert engine.run("network", "ls", "-q", "--filter", label).stdout.strip() == ""

