"""The soak benchmark (benchmarks/soak.py) with a small count: pools back to zero, no hang, errors == bad bodies,
RSS growth under 5 % (medians of the later against the earlier phases, glibc's mmap threshold fixed); and that
growth rule on recorded sample shapes."""

from __future__ import annotations

import sys

import pytest
from api_server_harness import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from soak import check, rss_growth, run_soak  # noqa: E402


@pytest.mark.slow
def test_soak_small() -> None:
    result = run_soak(count=300, concurrency=12, seed=3)
    assert result["bad_bodies_sent"] > 0
    assert not check(result), result


MB = 1 << 20


def test_rss_growth_ignores_allocator_swings_and_sees_a_leak() -> None:
    # The CPU engine's samples of 2026-11-27 (MB after warm-up, then after each 300-request phase): no trend.
    swings = [{"engine": v * MB} for v in (527, 545, 540, 543, 506, 543, 515, 537, 542)]
    assert abs(rss_growth(swings)["engine"]) < 0.05
    pairs = [(a["engine"] - b["engine"]) / b["engine"] for b, a in zip(swings, swings[1:], strict=False)]
    assert max(pairs) > 0.05  # one before/after pair of the same series could read as a leak
    # A steady leak of 10 MB a phase: the later minima rise with it.
    leak = [{"engine": (520 + 10 * i + (15 if i % 2 else 0)) * MB} for i in range(5)]
    assert rss_growth(leak)["engine"] == (560 - 520) / 520
    # One or two phases: the last sample against the baseline.
    assert rss_growth([{"api": 100 * MB}, {"api": 106 * MB}])["api"] == 0.06
    assert rss_growth([{"api": 100 * MB}, {"api": 90 * MB}, {"api": 106 * MB}])["api"] == 0.06
    result = {"outcomes": {}, "num_unexpected": 0, "server_errors_counted": 1, "bad_bodies_sent": 1,
              "healthy_after": True, "rss_growth": rss_growth(leak)}
    assert check(result) == ["engine RSS grew 7.7%"]
