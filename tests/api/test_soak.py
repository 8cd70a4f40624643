"""The soak benchmark (benchmarks/soak.py) with a small count: pools back to zero, no hang, errors == bad bodies,
RSS growth under 5 %."""

from __future__ import annotations

import sys

import pytest
from api_server_harness import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from soak import check, run_soak  # noqa: E402


@pytest.mark.slow
def test_soak_small() -> None:
    result = run_soak(count=300, concurrency=12, seed=3)
    assert result["bad_bodies_sent"] > 0
    assert not check(result), result
