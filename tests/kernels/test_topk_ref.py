"""The indexer's selection rule (kernels/topk_ref.py), checked on CPU against an independent Python oracle.

Rule: the k visible positions with the largest scores, equal scores won by the lower position, returned in
ascending position order; n <= k visible positions give 0..n−1 then −1; −0.0 equals +0.0; NaN ranks above +inf
(all NaNs equal); positions >= seq_len are never selected.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels.indexer_ref import index_scores_ref, indexer_topk_ref, quantize_index_keys
from kernels.topk_ref import order_keys, topk_positions_ref


def _oracle(row: list[float], n: int, k: int) -> list[int]:
    """Python sort by (NaN first, larger value first, lower position first) over the n visible positions."""
    if n <= k:
        return list(range(n)) + [-1] * (k - n)
    ranked = sorted(range(n), key=lambda p: (not math.isnan(row[p]), 0.0 if math.isnan(row[p]) else -row[p], p))
    return sorted(ranked[:k])


def _check(scores: torch.Tensor, lens: torch.Tensor, k: int) -> None:
    got = topk_positions_ref(scores, lens, k)
    assert got.dtype == torch.int32 and got.shape == (scores.shape[0], k)
    for r in range(scores.shape[0]):
        n = min(int(lens[r]), scores.shape[1])
        assert got[r].tolist() == _oracle(scores[r].tolist(), n, k), f"row {r}"


def test_hand_checked_ties_go_to_the_lower_position() -> None:
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.5]] * 4)
    lens = torch.tensor([6, 6, 6, 6])
    for k, want in [(1, [1]), (2, [1, 2]), (3, [1, 2, 4]), (4, [1, 2, 3, 4])]:
        assert topk_positions_ref(scores, lens, k)[0].tolist() == want
    # A row of equal scores keeps its first k positions.
    assert topk_positions_ref(torch.full((1, 10), 7.0), torch.tensor([10]), 4).tolist() == [[0, 1, 2, 3]]


def test_short_rows_and_lengths() -> None:
    scores = torch.randn(5, 12, generator=torch.Generator().manual_seed(0))
    got = topk_positions_ref(scores, torch.tensor([0, 1, 3, 4, 40]), 4)
    assert got[0].tolist() == [-1, -1, -1, -1]
    assert got[1].tolist() == [0, -1, -1, -1]
    assert got[2].tolist() == [0, 1, 2, -1]
    assert got[3].tolist() == [0, 1, 2, 3]  # n == k: every visible position
    assert got[4].tolist() == _oracle(scores[4].tolist(), 12, 4)  # seq_len beyond L: L visible
    # Fewer columns than k.
    assert topk_positions_ref(scores[:, :3], torch.tensor([3] * 5), 4)[0].tolist() == [0, 1, 2, -1]


def test_invisible_positions_are_never_selected() -> None:
    scores = torch.tensor([[0.0, 1.0, 2.0, float("inf"), float("nan"), 9.0]])
    assert topk_positions_ref(scores, torch.tensor([4]), 2).tolist() == [[2, 3]]
    assert topk_positions_ref(scores, torch.tensor([3]), 2).tolist() == [[1, 2]]


def test_order_keys_follow_the_float_order() -> None:
    values = [float("-inf"), -3.4e38, -1.0, -1e-30, -1e-45, -0.0, 0.0, 1e-45, 1e-30, 1.0, 3.4e38, float("inf")]
    floats = torch.tensor(values)
    keys = order_keys(floats).tolist()
    floats32 = floats.tolist()
    for i in range(len(values) - 1):
        a, b, ka, kb = floats32[i], floats32[i + 1], keys[i], keys[i + 1]
        assert (ka < kb) == (a < b) and (ka == kb) == (a == b), (a, b)
    nan_keys = order_keys(torch.tensor([float("nan"), -float("nan")])).tolist()
    assert nan_keys[0] == nan_keys[1] > keys[-1]


@pytest.mark.parametrize("kind", ["randn", "ties", "special"])
def test_matches_oracle(kind: str) -> None:
    gen = torch.Generator().manual_seed({"randn": 1, "ties": 2, "special": 3}[kind])
    rows, width, k = 24, 300, 40
    if kind == "randn":
        scores = torch.randn(rows, width, generator=gen)
    elif kind == "ties":
        scores = torch.randint(-3, 4, (rows, width), generator=gen).float()
    else:
        scores = torch.randn(rows, width, generator=gen)
        pick = torch.rand(rows, width, generator=gen)
        scores[pick < 0.2] = float("-inf")
        scores[(pick >= 0.2) & (pick < 0.25)] = float("nan")
        scores[(pick >= 0.25) & (pick < 0.4)] = 0.0
        scores[(pick >= 0.4) & (pick < 0.55)] = -0.0
        scores[(pick >= 0.55) & (pick < 0.6)] = float("inf")
    lens = torch.randint(0, width + 20, (rows,), generator=gen)
    lens[:4] = torch.tensor([k - 1, k, k + 1, width])
    _check(scores, lens, k)


def test_indexer_reference_uses_the_rule() -> None:
    """indexer_topk_ref = the rule applied to index_scores_ref, per query, over its own request's tokens."""
    gen = torch.Generator().manual_seed(3)
    keys, scales = quantize_index_keys(torch.randn(500, 128, generator=gen))
    token_rows = torch.stack([torch.randperm(500, generator=gen)[:200] for _ in range(2)]).to(torch.int32)
    token_req, seq_lens = torch.tensor([0, 1, 0, 1]), torch.tensor([200, 150, 31, 17])
    q, w = torch.randn(4, 8, 128, generator=gen), torch.randn(4, 8, generator=gen)
    got = indexer_topk_ref(q, w, keys, scales, token_rows, token_req, seq_lens, 32)
    for t in range(4):
        n = int(seq_lens[t])
        rows = token_rows[token_req[t], :n].long()
        s = index_scores_ref(q[t : t + 1], w[t : t + 1], keys[rows], scales[rows])
        assert got[t].tolist() == _oracle(s[0].tolist(), n, 32)
