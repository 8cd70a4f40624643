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
    # The CPU engine's samples of 2026-11-27 under glibc's dynamic mmap threshold (MB after warm-up, then after
    # each 300-request phase): swings, no trend.
    swings = [{"engine": v * MB} for v in (527, 545, 540, 543, 506, 543, 515, 537, 542)]
    assert rss_growth(swings)["engine"] == 539.5 / 541.5 - 1  # medians of phases 5-8 against 1-4
    pairs = [(a["engine"] - b["engine"]) / b["engine"] for b, a in zip(swings, swings[1:], strict=False)]
    assert max(pairs) > 0.05  # one before/after pair of the same series could read as a leak
    # A steady leak of 15 MB a phase under swings of 15 MB: the later half's median rises with it.
    leak = [{"engine": (520 + 15 * i + (15 if i % 2 else 0)) * MB} for i in range(7)]
    assert [s["engine"] // MB for s in leak[1:]] == [550, 550, 580, 580, 610, 610]
    assert rss_growth(leak)["engine"] == 610 / 550 - 1
    result = {"outcomes": {}, "num_unexpected": 0, "server_errors_counted": 1, "bad_bodies_sent": 1,
              "healthy_after": True, "rss_growth": rss_growth(leak)}
    assert check(result) == ["engine RSS grew 10.9%"]
    # One phase: its sample against the baseline; two: the second against the first.
    assert rss_growth([{"api": 100 * MB}, {"api": 106 * MB}])["api"] == 106 / 100 - 1
    assert rss_growth([{"api": 100 * MB}, {"api": 90 * MB}, {"api": 106 * MB}])["api"] == 106 / 90 - 1
