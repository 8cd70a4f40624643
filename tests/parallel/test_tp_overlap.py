"""Overlap scheduling on tensor-parallel ranks (2 CPU ranks over gloo, tiny-dsa, the real Engine with its parallel
state): the host one pass ahead of the device changes no request's tokens, and every rank stays in step.

Each rank runs tests/hisparse/test_overlap.py's retraction workload (tight budgets: retractions, some with a token
in flight; aborts landing while a pass is in flight; greedy and seeded sampling) synchronously and overlapped, dense
and HiSparse (whose ranks share one host pool: a page freed behind a pass in flight is reused only after every rank
read that pass). Batch-invariant mode, so a request's results do not depend on the passes it shared. What must
hold: on each rank, overlapped == synchronous (an aborted request: a prefix of its synchronous tokens, as on one
rank), both ranks produce the very same outcomes, retractions happened, and every pool ends empty.
"""

from __future__ import annotations

import pytest
from tp_overlap_workers import capture_agreement_rank, overlap_rank
from tp_workers import run_ranks

from decode_server.model import resolve_model_path


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    resolve_model_path("tiny-dsa")  # generate the checkpoint before the ranks race to
    return run_ranks(overlap_rank, tmp_path_factory.mktemp("tp_overlap"))


@pytest.mark.parametrize("mode", ["dense", "hisparse"])
def test_overlap_equals_sync_on_every_rank(ranks, mode: str) -> None:
    for rank, results in enumerate(ranks):
        sync, overlapped = results[mode]["sync"], results[mode]["overlap"]
        assert overlapped["retractions"] > 0, f"rank {rank}: the budget was meant to force retractions"
        assert sync["idle"] and overlapped["idle"], f"rank {rank}: a pool or request row was not given back"
        aborted = 0
        for rid, want in sync["outcomes"].items():
            got = overlapped["outcomes"][rid]
            if "abort" not in (want["finish"][0], got["finish"][0]):
                assert got == want, f"rank {rank} {mode} {rid}: overlapped differs from synchronous"
            else:
                aborted += 1
                assert got["tokens"] == want["tokens"][: len(got["tokens"])], f"rank {rank} {mode} {rid}"
        assert aborted > 0, "no abort landed"


@pytest.mark.parametrize("mode", ["dense", "hisparse"])
@pytest.mark.parametrize("schedule", ["sync", "overlap"])
def test_ranks_stay_in_step(ranks, mode: str, schedule: str) -> None:
    first, second = (r[mode][schedule] for r in ranks)
    assert first == second, f"{mode} {schedule}: the ranks' outcomes, retractions or dropped tokens differ"


def test_a_capture_failure_on_one_rank_makes_every_rank_eager(tmp_path) -> None:
    """Tensor-parallel ranks must all replay graphs or all run eagerly (their all-reduces must have the same sizes):
    when rank 1's capture fails, rank 0 (whose capture succeeded) drops its graphs too, and both say why."""
    first, second = run_ranks(capture_agreement_rank, tmp_path)
    assert first == {"runner": False, "error": "CUDA graph capture failed on another tensor-parallel rank"}
    assert second == {"runner": False, "error": "RuntimeError: capture failed here"}
