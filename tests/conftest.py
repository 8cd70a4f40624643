"""Fixtures for every test directory."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _restore_fp8_tuner() -> Iterator[None]:
    """A test that replaces the process's FP8 GEMM tuner (`reset_tuner("measure")`) gets a fresh default one after
    it, so the next test does not inherit its mode: in measure mode every shape counts as tuned, which changed
    what a later GPU test's model built (its "unfused" reference fused the shared expert, H200 2026-11-27). Looked
    up in sys.modules only: tests that never import the kernels (the router's, which must start without torch)
    import nothing here."""
    module = sys.modules.get("kernels.fp8_gemm")
    before = module.tuner() if module is not None else None
    yield
    module = sys.modules.get("kernels.fp8_gemm")
    if module is not None and module.tuner() is not before:
        module.reset_tuner()
