"""The block-FP8 Triton kernels' logic on CPU: fp8_triton_interpret_probe.py runs them in Triton's interpreter
(TRITON_INTERPRET=1, a fresh process) against kernels/fp8_gemm_ref.py — activation quantization equal to the
reference, dense GEMMs (split-K, ragged N and K, bf16 and float32 output) and the grouped GEMM (an empty expert,
an expert over several row tiles, programs per expert, split-K) within the float32 summation tolerance. The
compiled kernels are checked on the GPU by test_fp8_gemm_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton (the test extra) runs the kernels in its CPU interpreter")

PROBE = Path(__file__).with_name("fp8_triton_interpret_probe.py")
ROOT = Path(__file__).resolve().parents[2]


def test_fp8_triton_kernels_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(PROBE)], env=env, capture_output=True, text=True, timeout=600)
    print(proc.stdout)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "all interpreter cases passed" in proc.stdout
