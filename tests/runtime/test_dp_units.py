"""Data-parallel attention's pieces that need no ranks: the api's load balancing, the padding rule of the gathers,
the merging of the ranks' stats, and the configuration's checks."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from decode_server.api.engine_client import DPBalancer, _Route
from decode_server.config import EngineConfig
from decode_server.engine.types import DisaggStats, EngineStats, HiSparseLayerStats, PoolUsage
from decode_server.parallel.dp_attention import DPBatchLayout, use_max_len
from decode_server.parallel.state import ParallelState
from decode_server.runtime.dp_ranks import merge_rank_stats


def _routes(spec: list[tuple[int, int]]) -> list[_Route]:
    """(rank, tokens) per request in flight."""
    queue: asyncio.Queue = asyncio.Queue()
    return [_Route(queue, 0, rank, tokens) for rank, tokens in spec]


def test_shortest_queue_picks_fewest_requests_then_fewest_tokens_then_lowest_rank() -> None:
    balancer = DPBalancer(3, "shortest_queue")
    assert balancer.choose([]) == 0
    assert balancer.choose(_routes([(0, 10), (1, 10), (2, 10), (0, 10)])) == 1
    assert balancer.choose(_routes([(0, 900), (1, 10), (2, 500)])) == 1  # one request each: fewest tokens
    assert balancer.load(_routes([(0, 5), (2, 7), (2, 1)])) == ([1, 0, 2], [5, 0, 8])


def test_minimum_tokens_and_round_robin() -> None:
    tokens = DPBalancer(2, "minimum_tokens")
    assert tokens.choose(_routes([(0, 100), (1, 30), (1, 30)])) == 1  # fewer tokens despite more requests
    turn = DPBalancer(3, "round_robin")
    assert [turn.choose(_routes([(1, 1)] * 5)) for _ in range(4)] == [0, 1, 2, 0]
    assert DPBalancer(1, "shortest_queue").choose(_routes([(0, 1)])) == 0


def test_cache_aware_follows_the_rank_that_cached_the_prompts_start() -> None:
    """A prompt whose start (at least half of it) a rank got before goes there, even where the shortest queue would
    pick another; a new prompt takes the shortest queue; an imbalance beyond 32 requests overrides the prefix."""
    system_a = list(range(100, 200))
    system_b = list(range(300, 400))
    balancer = DPBalancer(2, "cache_aware")
    assert balancer.choose([], system_a + [1, 2]) == 0  # nothing known: shortest queue (tie → rank 0)
    assert balancer.choose(_routes([(0, 10)]), system_b + [3]) == 1  # rank 0 busy
    assert balancer.choose([], system_b + [4, 5]) == 1  # idle ranks: the shortest queue says 0, B's start is on 1
    assert balancer.choose([], system_a + [6]) == 0
    assert balancer.choose([], list(range(900, 960)) + system_b) == 0  # B's tokens later in the prompt: no start
    assert balancer.decisions == {"hit": 2, "miss": 3, "imbalanced": 0}
    busy = _routes([(1, 10)] * 40)
    assert balancer.choose(busy, system_b + [7]) == 0  # 40 requests on rank 1, none on 0: balance first
    assert balancer.decisions["imbalanced"] == 1
    assert balancer.choose([], system_b + [8]) == 0  # ... and B's start now points at rank 0
    plain = DPBalancer(2, "shortest_queue")
    assert plain.choose([], system_b + [4, 5]) == 0 and plain.affinity is None


def test_padding_rule_prefers_max_len_unless_counts_are_very_uneven() -> None:
    assert use_max_len((8, 8)) and use_max_len((2048, 0))  # 2 ranks: always (sum >= max)
    assert use_max_len((4, 4, 4, 4)) and use_max_len((4, 4, 4, 0))
    assert not use_max_len((2048, 1, 1, 1, 0, 0, 0, 0))  # one rank prefilling among 8: sum-len
    layout = DPBatchLayout((3, 0), (1, 0), 1)
    assert layout.idle and layout.total_tokens == 3 and layout.size == 2


def test_ranks_stats_are_summed_and_kept_per_rank() -> None:
    def rank_stats(n: int) -> EngineStats:
        return EngineStats(
            num_running_reqs=n, num_queue_reqs=2 * n, token_usage=0.1 * n, num_generated_tokens=10 * n,
            num_steps=n, num_idle_passes=3 - n, hisparse_enabled=True,
            hisparse_layers=[HiSparseLayerStats(layer=0, hits=n, misses=1),
                             HiSparseLayerStats(layer=1, speculative_rows_saved=5 * n - 6)],
            host_pages=PoolUsage(used=n, total=8), dense_kv_slots=PoolUsage(used=0, total=0),
            weights_bytes=100, disagg=DisaggStats(mode="decode", transfer_bytes=1000 * n,
                                                  rooms_finished={"SUCCESS": n}, latency_bucket_counts=[n, 1]),
        )  # fmt: skip

    merged = merge_rank_stats([(11, rank_stats(1)), (22, rank_stats(2))])
    assert (merged.num_running_reqs, merged.num_queue_reqs, merged.num_generated_tokens) == (3, 6, 30)
    assert merged.token_usage == pytest.approx(0.15) and merged.num_idle_passes == 3
    assert merged.host_pages == PoolUsage(used=3, total=16) and merged.weights_bytes == 100
    assert merged.hisparse_layers[0].hits == 3 and merged.hisparse_layers[0].misses == 2
    # the bets' payoff sums over the ranks (it may be negative on one); a layer without one stays without
    assert merged.hisparse_layers[1].speculative_rows_saved == 3 and merged.hisparse_layers[0].speculative_rows_saved is None
    assert merged.disagg.transfer_bytes == 3000 and merged.disagg.rooms_finished == {"SUCCESS": 3}
    assert merged.disagg.latency_bucket_counts == [3, 2]
    assert [(r.dp_rank, r.pid, r.num_running_reqs, r.kv_transfer_bytes) for r in merged.dp_ranks] == [
        (0, 11, 1, 1000), (1, 22, 2, 2000)]


def test_config_and_state_checks() -> None:
    cfg = EngineConfig(tp_size=4, dp_size=4, enable_dp_attention=True, ep_size=4)
    assert cfg.dp_attention_size == 4 and cfg.attention_tp_size == 1
    assert EngineConfig(tp_size=4).attention_tp_size == 4 and EngineConfig().dp_attention_size == 1
    EngineConfig(tp_size=2, dp_size=2, enable_dp_attention=True, disaggregation={"mode": "decode"})
    EngineConfig(tp_size=2, disaggregation={"mode": "decode"})  # rank 0 receives for the group (tp_ranks.py)
    EngineConfig(tp_size=2, disaggregation={"mode": "prefill"})  # rank 0 sends for the group
    with pytest.raises(ValidationError, match="--enable-dp-attention with --disaggregation-mode prefill"):
        EngineConfig(tp_size=2, dp_size=2, enable_dp_attention=True, disaggregation={"mode": "prefill"})
    state = ParallelState(tp_rank=1, tp_size=2, dp_size=2, ep_size=2)
    assert state.dp_attention and state.dp_rank == 1 and state.attention_tp_size == 1
    assert state.attention_state().tp_size == 1 and ParallelState(tp_size=2).attention_state().tp_size == 2
    with pytest.raises(ValueError, match="attention tensor parallelism inside a DP rank"):
        ParallelState(tp_size=4, dp_size=2)
    with pytest.raises(ValueError, match="enable_dp_lm_head needs data-parallel attention"):
        ParallelState(tp_size=2, enable_dp_lm_head=True)


def test_metrics_carry_each_rank() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from decode_server.api.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.latest_stats = merge_rank_stats([(1, EngineStats(num_running_reqs=2, num_idle_passes=0)),
                                             (2, EngineStats(num_running_reqs=5, num_idle_passes=7))])  # fmt: skip
    metrics.dp_inflight = ([3, 6], [30, 60])
    samples = {(s.name, s.labels.get("dp_rank")): s.value
               for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}  # fmt: skip
    assert samples[("sglang:num_running_reqs", None)] == 7
    assert samples[("hisparse:dp_num_running_reqs", "1")] == 5
    assert samples[("hisparse:dp_num_idle_passes_total", "1")] == 7
    assert samples[("hisparse:dp_inflight_requests", "0")] == 3 and samples[("hisparse:dp_inflight_tokens", "1")] == 60
    assert not any(name.startswith("hisparse:dp_") for name, _ in {
        (s.name, 0) for f in text_string_to_metric_families(ServerMetrics("m").render().decode()) for s in f.samples})
