"""The indexer's Triton kernels without a GPU: run by Triton's interpreter against the references, and compiled
for sm_90 with their speed-critical properties checked (tests/kernels/triton_cpu_checks.py; one process per
check, since the interpreter is chosen when triton is imported). Skipped where triton is not installed (the
Makefile installs it on machines without a GPU, where torch does not bring it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("triton_cpu_checks.py")
CHECKS = ["interpret-topk", "interpret-scores", "compile-topk", "compile-scores-fp16", "compile-scores-fp16x2",
          "compile-scores-fp8"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("check", CHECKS)
def test_triton_kernel_without_gpu(check: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), check], capture_output=True, text=True, env=env,
                          timeout=840)
    assert done.returncode == 0, f"{check} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert "FAILED" not in done.stdout
