"""Routing policies: which healthy prefill and which healthy decode worker serve the next request.

Prefill and decode are chosen independently (any prefill can hand its KV to any decode). `exclude` holds the
workers that already failed this request, so a retry goes elsewhere when there is an elsewhere. `text` is the
request's prompt text (`prefix_affinity.affinity_text`), read only by the cache_aware policy.
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence

from decode_server.router.config import RouterConfig
from decode_server.router.prefix_affinity import PrefixAffinity
from decode_server.router.workers import Worker


class Policy(ABC):
    name = "base"
    uses_text = False  # whether `pick` needs the request's prompt text

    def pick(self, workers: Sequence[Worker], exclude: Collection[Worker] = (), text: str = "") -> Worker | None:
        candidates = [w for w in workers if w.healthy and w not in exclude]
        if not candidates:
            # Every healthy worker already failed this request: trying one of them again beats giving up.
            candidates = [w for w in workers if w.healthy]
        return self._choose(candidates, text) if candidates else None

    @abstractmethod
    def _choose(self, candidates: list[Worker], text: str) -> Worker:
        """The worker this policy picks among healthy candidates."""


class RoundRobin(Policy):
    """Each healthy worker in turn (a counter over the healthy list, so a dead worker costs no turn)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def _choose(self, candidates: list[Worker], text: str) -> Worker:
        return candidates[next(self._counter) % len(candidates)]


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def _choose(self, candidates: list[Worker], text: str) -> Worker:
        return self._rng.choice(candidates)


class LeastLoad(Policy):
    """The worker with the fewest running + waiting requests (from its `GET /load`, or the router's own count
    when that is higher), ties broken by the most free host-pool pages, then by list order."""

    name = "least_load"

    def _choose(self, candidates: list[Worker], text: str) -> Worker:
        return min(candidates, key=Worker.load_score)


class CacheAware(Policy):
    """SGLang's cache_aware routing for prefill servers that cache prefixes (`--enable-prefix-caching`): a prompt
    goes to the worker that got the longest start of it, when that start is at least `cache_threshold` of the
    prompt, so its cached KV is reused; otherwise to the worker with the fewest requests in flight (then the one
    holding the fewest remembered prefixes, whose cache has the most room). While the load is out of balance
    (the busiest worker has more than `balance_abs_threshold` requests above the idlest and more than
    `balance_rel_threshold` times its count) every request goes to the idlest, prefix or not. Loads are the
    router's own in-flight counts."""

    name = "cache_aware"
    uses_text = True

    def __init__(self, cache_threshold: float, balance_abs_threshold: int, balance_rel_threshold: float,
                 max_tree_size: int, on_decision: Callable[[str], None] | None = None) -> None:  # fmt: skip
        """`on_decision(outcome)`: told `hit`, `miss` or `imbalanced` for every choice (the router's metric)."""
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.affinity: PrefixAffinity[Worker] = PrefixAffinity(max_tree_size)
        self.on_decision = on_decision

    def _choose(self, candidates: list[Worker], text: str) -> Worker:
        loads = [w.inflight for w in candidates]
        idlest = min(candidates, key=lambda w: (w.inflight, self.affinity.count_for(w)))
        if (max(loads) - min(loads) > self.balance_abs_threshold
                and max(loads) > min(loads) * self.balance_rel_threshold):
            choice, outcome = idlest, "imbalanced"
        else:
            owner, share = self.affinity.match(text)
            hit = owner is not None and owner in candidates and share >= self.cache_threshold
            choice, outcome = (owner, "hit") if hit and owner is not None else (idlest, "miss")
        self.affinity.record(text, choice)
        if self.on_decision is not None:
            self.on_decision(outcome)
        return choice


def make_policy(name: str, config: RouterConfig | None = None,
                on_decision: Callable[[str], None] | None = None) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomPolicy()
    if name == "least_load":
        return LeastLoad()
    if name == "cache_aware":
        c = config if config is not None else RouterConfig.model_construct()
        return CacheAware(c.cache_threshold, c.balance_abs_threshold, c.balance_rel_threshold, c.max_tree_size,
                          on_decision)
    raise ValueError(f"unknown policy {name!r}")
