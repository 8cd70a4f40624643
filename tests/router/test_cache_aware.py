"""The cache_aware policy without servers: prompt-start memory (chained block names, LRU bound, per-worker counts),
the text a request is routed by, and the choice between the worker that saw a prompt's start and the idlest."""

from __future__ import annotations

import pytest

from decode_server.router.config import RouterConfig
from decode_server.router.policy import CacheAware, make_policy
from decode_server.router.prefix_affinity import BLOCK_CHARS, PrefixAffinity, affinity_text
from decode_server.router.workers import Worker

SYSTEM_A = "You are a careful assistant who answers in French. " * 6
SYSTEM_B = "You are a terse assistant who answers in haiku only. " * 6


def workers(n: int = 2) -> list[Worker]:
    return [Worker(f"http://127.0.0.1:{30000 + i}", "prefill", healthy=True) for i in range(n)]


def test_affinity_matches_the_longest_remembered_start():
    memory: PrefixAffinity[str] = PrefixAffinity(max_chars=1 << 20)
    memory.record(SYSTEM_A + "first question", "w0")
    owner, share = memory.match(SYSTEM_A + "another question entirely")
    assert owner == "w0" and share == pytest.approx((len(SYSTEM_A) // BLOCK_CHARS) * BLOCK_CHARS
                                                     / len(SYSTEM_A + "another question entirely"))
    assert memory.match("x" + SYSTEM_A) == (None, 0.0)  # names are chained: the same text elsewhere is no match
    assert memory.match("short") == (None, 0.0)
    memory.record(SYSTEM_A + "again", "w1")  # the latest worker to get a start owns it
    assert memory.match(SYSTEM_A)[0] == "w1"
    # 320 characters (5 blocks) went to w0, then the first 4 of them to w1.
    assert len(SYSTEM_A + "first question") == 5 * BLOCK_CHARS and len(SYSTEM_A + "again") < 5 * BLOCK_CHARS
    assert memory.count_for("w0") == 1 and memory.count_for("w1") == 4


def test_affinity_is_bounded_least_recently_used_first():
    memory: PrefixAffinity[str] = PrefixAffinity(max_chars=6 * BLOCK_CHARS)
    memory.record(SYSTEM_A[: 4 * BLOCK_CHARS], "w0")
    memory.record(SYSTEM_B[: 4 * BLOCK_CHARS], "w1")  # 8 names > 6: w0's two oldest dropped
    assert len(memory) == 6 and memory.count_for("w0") == 2 and memory.count_for("w1") == 4
    assert memory.match(SYSTEM_A)[0] is None  # its first block is gone, so the chain breaks at once
    assert memory.match(SYSTEM_B)[0] == "w1"


def test_affinity_text_of_each_request_shape():
    assert affinity_text({"prompt": "hello"}) == "hello"
    assert affinity_text({"prompt": [5, 6, 7]}) == "5 6 7"
    assert affinity_text({"prompt": ["first", "second"]}) == "first"
    assert affinity_text({"prompt": [[1, 2], [3]]}) == "1 2"
    assert affinity_text({"text": "native"}) == "native"  # /generate
    assert affinity_text({"text": ["a", "b"]}) == "a" and affinity_text({"input_ids": [[4, 5], [6]]}) == "4 5"
    chat = {"messages": [{"role": "system", "content": "S"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert affinity_text(chat) == "<system>S<user>ab"
    assert affinity_text({}) == ""


def test_prompts_follow_the_worker_that_saw_their_start():
    decisions: list[str] = []
    policy = make_policy("cache_aware", RouterConfig.model_construct(), decisions.append)
    w = workers()
    chosen = [policy.pick(w, (), system + f"question {i}") for i in range(3) for system in (SYSTEM_A, SYSTEM_B)]
    assert chosen == [w[0], w[1]] * 3  # B's first prompt went to the worker holding fewer remembered starts
    assert decisions == ["miss", "miss"] + ["hit"] * 4


def test_below_the_threshold_or_out_of_balance_the_idlest_gets_it():
    decisions: list[str] = []
    policy = CacheAware(cache_threshold=0.5, balance_abs_threshold=2, balance_rel_threshold=1.5,
                        max_tree_size=1 << 20, on_decision=decisions.append)
    w = workers()
    assert policy.pick(w, (), SYSTEM_A) is w[0]
    w[0].inflight = 1
    # A prompt that shares its start with A's, but mostly is something else: under the threshold.
    assert policy.pick(w, (), SYSTEM_A[:BLOCK_CHARS] + "z" * 400) is w[1]
    w[0].inflight = 2
    assert policy.pick(w, (), SYSTEM_A) is w[0]  # a gap of 2 is not over the absolute threshold
    w[0].inflight = 3
    assert policy.pick(w, (), SYSTEM_A) is w[1]  # 3 vs 0: over both thresholds
    assert decisions == ["miss", "miss", "hit", "imbalanced"]


def test_an_unhealthy_or_failed_owner_is_passed_over():
    policy = make_policy("cache_aware", RouterConfig.model_construct())
    w = workers()
    assert policy.pick(w, (), SYSTEM_A) is w[0]
    assert policy.pick(w, {w[0]}, SYSTEM_A) is w[1]  # a retry after w[0] failed the request
    w[1].healthy = False
    assert policy.pick(w, (), SYSTEM_A) is w[0]


def test_policies_per_role():
    specs = {"prefill": [{"url": "127.0.0.1:1"}], "decode": [{"url": "127.0.0.1:2"}]}
    config = RouterConfig(**specs, policy="cache_aware")
    assert (config.resolved_prefill_policy, config.resolved_decode_policy) == ("cache_aware", "round_robin")
    config = RouterConfig(**specs, policy="round_robin", prefill_policy="cache_aware", decode_policy="least_load")
    assert (config.resolved_prefill_policy, config.resolved_decode_policy) == ("cache_aware", "least_load")
    with pytest.raises(ValueError, match="decode servers receive every prompt's KV"):
        RouterConfig(**specs, decode_policy="cache_aware")
