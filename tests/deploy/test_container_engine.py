"""The helpers of the image test (tests/deploy/container_engine.py) that decide what the build is given, and
when the test may skip: checked without an engine, in `make test`."""

from __future__ import annotations

import os
from pathlib import Path

import container_engine
import pytest

LISTING = """\
:env:.cert='/etc/ssl/certs/env.crt'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/file.crt'
global.extra-index-url='file:///opt/pypi/simple https://mirror.example/simple'
global.index-url='https://pypi.example/simple'
"""


def test_pip_settings_become_build_args() -> None:
    config = container_engine.parse_pip_config(LISTING)
    assert config["cert"] == "/etc/ssl/certs/env.crt"  # PIP_CERT over the file
    assert container_engine.pip_build_args(config) == {
        "PIP_INDEX_URL": "https://pypi.example/simple",
        "PIP_EXTRA_INDEX_URL": "https://mirror.example/simple",  # file:// cannot be reached from a build
    }
    assert container_engine.pip_build_args({}) == {}


def test_ca_bundle_and_local_torch_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    assert container_engine.pip_ca_bundle({"cert": str(ca)}) == ca
    assert container_engine.pip_ca_bundle({"cert": str(tmp_path / "missing.crt")}) is None

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    arch = os.uname().machine
    tag = container_engine.BASE_PYTHON_TAG
    for name in (f"torch-2.13.0-{tag}-{tag}-manylinux_2_28_{arch}.whl",  # CUDA build: not taken
                 f"torch-2.13.0+cpu-cp312-cp312-manylinux_2_28_{arch}.whl",  # another Python
                 f"torch-2.12.0+cpu-{tag}-{tag}-manylinux_2_28_{arch}.whl"):  # another version  # fmt: skip
        (wheels / name).touch()
    config = {"find-links": f"https://example.invalid/wheels file://{wheels}"}
    assert container_engine.local_cpu_torch_wheel(config, "2.13.0") is None
    wanted = wheels / f"torch-2.13.0+cpu-{tag}-{tag}-manylinux_2_28_{arch}.whl"
    wanted.touch()
    assert container_engine.local_cpu_torch_wheel(config, "2.13.0") == wanted


def test_served_wheel_is_a_find_links_page(tmp_path: Path) -> None:
    import httpx

    wheel = tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"PK\x05\x06" + bytes(18))
    with container_engine.serve_wheel(wheel) as url:
        assert url.startswith("http://127.0.0.1:")
        listing = httpx.get(url, timeout=10).text
        assert "torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl" in listing
        assert httpx.get(url + "torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl").content == (
            wheel.read_bytes())


def test_served_wheel_keeps_its_port(tmp_path: Path) -> None:
    """The URL is part of the build cache's key: the same port next time, a new one only when it is taken."""
    wheel = tmp_path / "w.whl"
    wheel.write_bytes(b"x")
    port_file = tmp_path / "port"
    with (
        container_engine.serve_wheel(wheel, port_file) as first,
        container_engine.serve_wheel(wheel, port_file) as taken,  # first's port is in use: another
    ):
        assert taken != first
    with container_engine.serve_wheel(wheel, port_file) as again:
        assert again == taken


def test_torch_version_is_read_from_the_dockerfile() -> None:
    from deploy_checks import REPO

    assert container_engine.torch_version(REPO / "Dockerfile") == "2.13.0"


def test_skips_only_without_engine_and_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """No engine answers and dockerd cannot be started (not root): Unavailable, with the reason."""
    monkeypatch.setattr(container_engine.shutil, "which", lambda *a, **k: None)
    monkeypatch.setattr(container_engine.os, "geteuid", lambda: 1000)
    with pytest.raises(container_engine.Unavailable, match="no docker CLI on PATH.*needs root"), (
        container_engine.engine_session()
    ):
        pass
