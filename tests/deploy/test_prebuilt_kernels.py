"""Kernels compiled at image build time (`python -m decode_server.ops build-kernels`): load_extension imports a
stamped build only when the stamp matches this source, torch and architecture; the GPU test builds one ahead of
time and loads it in a fresh process without a compiler on PATH."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cuda_ext


def _stamp(build_dir: Path, **overrides: str) -> Path:
    build_dir.mkdir(parents=True)
    library = build_dir / "hisparse_kernels_sm90a.so"
    library.write_bytes(b"\x7fELF")
    stamp = {"arch": "90a", "source_sha256": cuda_ext.source_digest(), "torch": torch.__version__,
             "library": library.name, **overrides}  # fmt: skip
    (build_dir / "prebuilt.json").write_text(json.dumps(stamp))
    return library


def test_stamp_must_match_source_torch_and_arch(tmp_path: Path) -> None:
    library = _stamp(tmp_path / "ok")
    assert cuda_ext.prebuilt_library(tmp_path / "ok", "90a") == library
    assert cuda_ext.prebuilt_library(tmp_path / "ok", "100") is None
    _stamp(tmp_path / "edited", source_sha256="0" * 64)  # the .cu changed since the build
    assert cuda_ext.prebuilt_library(tmp_path / "edited", "90a") is None
    _stamp(tmp_path / "torch", torch="1.0.0")
    assert cuda_ext.prebuilt_library(tmp_path / "torch", "90a") is None
    assert cuda_ext.prebuilt_library(tmp_path / "missing", "90a") is None
    (tmp_path / "ok" / "hisparse_kernels_sm90a.so").unlink()
    assert cuda_ext.prebuilt_library(tmp_path / "ok", "90a") is None


def test_arch_names() -> None:
    assert cuda_ext.arch_for_capability(9, 0) == "90a"
    assert cuda_ext.arch_for_capability(10, 0) == "100"
    assert cuda_ext.arch_for_capability(8, 0) == "80"


@pytest.mark.gpu
def test_build_ahead_then_load_without_compiler(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    arch = cuda_ext.arch_for_capability(*torch.cuda.get_device_capability())
    subprocess.run([sys.executable, "-m", "decode_server.ops", "build-kernels", "--arch", arch,
                    "--cache-dir", str(tmp_path)], check=True, timeout=1800)  # fmt: skip
    check = ("import logging, torch; logging.basicConfig(level=logging.INFO); "
             "from kernels.cuda_ext import load_extension; m = load_extension(); "
             "assert hasattr(m, 'swap_in') and hasattr(m, 'backup'), dir(m)")  # fmt: skip
    env = dict(os.environ, HISPARSE_KERNEL_CACHE=str(tmp_path), PATH="/usr/bin:/bin", CUDA_HOME="/nonexistent")
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "loading prebuilt HiSparse CUDA kernels" in out.stderr
