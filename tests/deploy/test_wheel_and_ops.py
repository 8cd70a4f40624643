"""The install path the image takes, without a container engine: the project's wheel builds, installs into a
fresh virtualenv and `decode-server serve` answers there (tiny-dsa on CPU, from the wheel's own configs); the
ops helpers the image and the manifests use (`probe`, `wait-idle`) work against that server.

Starting a server costs ~40 s on a loaded 2-core machine, so the tests that need one are marked `slow`; the
wheel's build, contents and installation (imports from the venv, tiny-dsa's config found) run in `make test`.

The virtualenv is made without pip's network: the wheel is installed with --no-deps, and the test
environment's site-packages is appended to the venv's path (a .pth file) so that torch and the other
dependencies are not downloaded again; the package itself is imported from the venv (checked)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from deploy_checks import REPO, docker_context_paths

START_TIMEOUT_S = 180


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip wheel . --no-deps` on what .dockerignore lets into the build context (the image's first stage)."""
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in docker_context_paths():
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, symlinks=True, ignore=ignore)
        elif (REPO / name).is_file():
            shutil.copy(REPO / name, src / name)
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                    "--wheel-dir", str(out), str(src)], check=True, timeout=300, env=_clean_env())  # fmt: skip
    (path,) = out.glob("hisparse_decode_server-*.whl")
    return path


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    py = root / "bin" / "python"
    site = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())  # fmt: skip
    (site / "_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                    "--no-index", "--force-reinstall", str(wheel)], check=True, timeout=300, env=_clean_env())  # fmt: skip
    return root


@pytest.fixture(scope="module")
def server(venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    work = tmp_path_factory.mktemp("run")
    log = (work / "server.log").open("w")
    proc = subprocess.Popen(
        [str(venv / "bin" / "decode-server"), "serve", "--model-path", "tiny-dsa", "--device", "cpu",
         "--host", "127.0.0.1", "--port", str(port), "--context-length", "256"],
        cwd=work, stdout=log, stderr=subprocess.STDOUT,
        env=_clean_env(HISPARSE_CACHE_DIR=str(work / "cache")),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, (work / "server.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (work / "server.log").read_text()
            time.sleep(0.3)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()


def _ops(venv: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / "python"), "-m", "decode_server.ops", *args], capture_output=True,
                          text=True, timeout=timeout, env=_clean_env(), cwd="/")  # fmt: skip


def test_wheel_carries_configs_and_kernel_sources(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"decode_server/model/configs/tiny-dsa.json", "decode_server/ops.py",
            "kernels/csrc/hisparse_kernels.cu", "kernels/csrc/topk_kernels.cu"} <= names  # fmt: skip


def test_wheel_installs_and_imports_from_the_venv(venv: Path) -> None:
    code = ("import decode_server, kernels; from decode_server.model.tiny import tiny_config_dict; "
            "assert tiny_config_dict()['model_type'] == 'deepseek_v32'; print(decode_server.__file__, kernels.__file__)")
    where = subprocess.check_output([str(venv / "bin" / "python"), "-c", code], text=True, env=_clean_env(),
                                    cwd="/").split()  # fmt: skip
    assert len(where) == 2 and all(path.startswith(str(venv)) for path in where), where
    assert (venv / "bin" / "decode-server").exists()


def test_ops_without_a_server(venv: Path) -> None:
    from decode_server.ops import busy_requests

    text = ('# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name="m"} 2.0\n'
            'sglang:num_queue_reqs{model_name="m"} 1.0\nsglang:num_retracted_reqs{model_name="m"} 5.0\n')
    assert busy_requests(text) == 3
    assert busy_requests(text.replace("2.0", "0.0").replace(" 1.0", " 0.0")) == 0
    gone = f"http://127.0.0.1:{_free_port()}"
    assert _ops(venv, "probe", gone + "/health", "--timeout", "2").returncode == 1
    assert _ops(venv, "wait-idle", gone, "--timeout", "5").returncode == 0  # nothing left to finish


@pytest.mark.slow
def test_installed_server_answers(server: str) -> None:
    assert httpx.get(server + "/health", timeout=5).status_code == 200
    body = {"model": "tiny-dsa", "prompt": "hello", "max_tokens": 4}
    reply = httpx.post(server + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4


@pytest.mark.slow
def test_probe(venv: Path, server: str) -> None:
    assert _ops(venv, "probe", server + "/health").returncode == 0
    assert _ops(venv, "probe", server + "/no-such-route").returncode == 1
    assert _ops(venv, "probe", f"http://127.0.0.1:{_free_port()}/health", "--timeout", "2").returncode == 1


@pytest.mark.slow
def test_wait_idle_waits_for_running_requests(venv: Path, server: str) -> None:
    assert _ops(venv, "wait-idle", server, "--interval", "0.1").returncode == 0  # idle: returns at once
    finished: list[float] = []
    started = threading.Event()

    def long_request() -> None:
        # 240 tokens (the server's context is 256) take over a second on tiny-dsa; 16 once finished before the
        # first wait-idle (0.14 s to start, 0.2 s timeout) looked.
        body = {"model": "tiny-dsa", "prompt": "hello", "max_tokens": 240, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server + "/v1/completions", json=body, timeout=120) as resp:
            for _ in resp.iter_lines():
                started.set()
        finished.append(time.monotonic())

    thread = threading.Thread(target=long_request)
    thread.start()
    try:
        assert started.wait(60)
        # Too short a timeout: the request is still running, wait-idle reports failure.
        assert _ops(venv, "wait-idle", server, "--interval", "0.1", "--timeout", "0.2").returncode == 1
        out = _ops(venv, "wait-idle", server, "--interval", "0.1", "--timeout", "120", timeout=150)
        returned = time.monotonic()
    finally:
        thread.join(150)
    assert out.returncode == 0, out.stderr
    assert finished and finished[0] <= returned
