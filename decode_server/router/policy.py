"""Routing policies: which healthy prefill and which healthy decode worker serve the next request.

Prefill and decode are chosen independently (any prefill can hand its KV to any decode). `exclude` holds the
workers that already failed this request, so a retry goes elsewhere when there is an elsewhere.
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence

from decode_server.router.workers import Worker


class Policy(ABC):
    name = "base"

    def pick(self, workers: Sequence[Worker], exclude: Collection[Worker] = ()) -> Worker | None:
        candidates = [w for w in workers if w.healthy and w not in exclude]
        if not candidates:
            # Every healthy worker already failed this request: trying one of them again beats giving up.
            candidates = [w for w in workers if w.healthy]
        return self._choose(candidates) if candidates else None

    @abstractmethod
    def _choose(self, candidates: list[Worker]) -> Worker:
        """The worker this policy picks among healthy candidates."""


class RoundRobin(Policy):
    """Each healthy worker in turn (a counter over the healthy list, so a dead worker costs no turn)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def _choose(self, candidates: list[Worker]) -> Worker:
        return candidates[next(self._counter) % len(candidates)]


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def _choose(self, candidates: list[Worker]) -> Worker:
        return self._rng.choice(candidates)


class LeastLoad(Policy):
    """The worker with the fewest running + waiting requests (from its `GET /load`, or the router's own count
    when that is higher), ties broken by the most free host-pool pages, then by list order."""

    name = "least_load"

    def _choose(self, candidates: list[Worker]) -> Worker:
        return min(candidates, key=Worker.load_score)


def make_policy(name: str) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomPolicy()
    if name == "least_load":
        return LeastLoad()
    raise ValueError(f"unknown policy {name!r}")
