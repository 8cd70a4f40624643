"""Prometheus metrics: SGLang's names for what SGLang users already chart, `hisparse:` names for ours.

Two sources feed one registry:
- the engine's `EngineStats` snapshot (queue sizes, token usage, token totals, per-layer swap-in counters, pool
  usage), exported by a collector that reads the latest snapshot at scrape time;
- request timings the api process observes itself (time to first token, inter-token latency, end-to-end
  latency) and the generation throughput over a sliding window.

Every series carries the label `model_name`, as SGLang's do. A private `CollectorRegistry` keeps tests and
multiple servers in one process from colliding.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from decode_server.engine.types import KV_TRANSFER_LATENCY_BUCKETS, DisaggStats, EngineStats

SGLANG = "sglang:"
HISPARSE = "hisparse:"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ThroughputWindow:
    """Tokens per second over the last `window_s` seconds (what SGLang's `gen_throughput` gauge reports)."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def add(self, num_tokens: int, now: float | None = None) -> None:
        """Record tokens; events older than the window are dropped here too, not only when someone reads the
        rate: a server nobody scrapes must not keep one entry per token batch forever (the 10,000-request soak
        found the api process growing by 9 MB that way)."""
        if num_tokens <= 0:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            self._events.append((now, num_tokens))
            self._drop_older_than(now - self.window_s)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._drop_older_than(now - self.window_s)
            return sum(n for _, n in self._events) / self.window_s

    def __len__(self) -> int:
        return len(self._events)

    def _drop_older_than(self, cutoff: float) -> None:
        while self._events and self._events[0][0] < cutoff:
            self._events.popleft()


class _EngineStatsCollector(Collector):
    """Exports the newest `EngineStats` snapshot; stats the engine counts cumulatively become counters."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        stats = m.latest_stats
        labels = [m.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        yield gauge(SGLANG + "num_running_reqs", "requests in the decode batch", stats.num_running_reqs)
        yield gauge(SGLANG + "num_queue_reqs", "requests waiting to be admitted", stats.num_queue_reqs)
        yield gauge(
            SGLANG + "num_retracted_reqs", "requests retracted back to the queue", stats.num_retracted_reqs
        )
        yield gauge(SGLANG + "token_usage", "fraction of the binding KV pool in use", stats.token_usage)
        yield gauge(
            SGLANG + "gen_throughput", "generated tokens per second (10 s window)", m.throughput.rate()
        )
        yield gauge(
            SGLANG + "engine_alive",
            "1 while the engine process is running, 0 once it died",
            float(m.engine_alive),
        )
        yield counter(SGLANG + "prompt_tokens", "prompt tokens prefilled", stats.num_prompt_tokens)
        yield counter(SGLANG + "generation_tokens", "tokens generated", stats.num_generated_tokens)
        yield counter(SGLANG + "num_engine_steps", "engine steps run", stats.num_steps)
        yield counter(SGLANG + "num_retractions", "times a request was retracted", stats.num_retractions)
        if stats.prefix_cache is not None:  # prefix caching on (--enable-prefix-caching)
            pc = stats.prefix_cache
            yield gauge(SGLANG + "cache_hit_rate", "prompt tokens found in the prefix cache / prompt tokens admitted",
                        pc.hit_rate)
            yield counter(SGLANG + "cached_tokens", "prompt tokens whose KV came from the prefix cache",
                          pc.hit_tokens)
            yield gauge(HISPARSE + "prefix_cache_tokens", "tokens whose KV pages the prefix cache holds",
                        pc.cached_tokens)
            yield gauge(HISPARSE + "prefix_cache_evictable_tokens",
                        "prefix-cache tokens no request maps (freed when a pool runs short)", pc.evictable_tokens)
            yield counter(HISPARSE + "prefix_cache_evicted_tokens", "prefix-cache tokens evicted or flushed",
                          pc.evicted_tokens)

        yield gauge(
            HISPARSE + "enabled", "1 when HiSparse (host KV pool) mode is on", float(stats.hisparse_enabled)
        )
        yield gauge(HISPARSE + "weights_bytes", "device bytes of the model weights (rank 0's with TP)",
                    stats.weights_bytes)
        by_kind = GaugeMetricFamily(HISPARSE + "weights_bytes_by_kind",
                                    "device bytes of the model weights by kind (fp8, fp8_scales, absorbed, other)",
                                    labels=["model_name", "kind"])
        for kind, value in sorted(stats.weights_bytes_by_kind.items()):
            by_kind.add_metric([m.model_name, kind], value)
        yield by_kind
        for pool_name, pool, unit in (
            ("host_pool", stats.host_pages, "pages"),
            ("device_buffer", stats.device_slots, "slots"),
            ("indexer_cache", stats.indexer_slots, "slots"),
            ("dense_kv", stats.dense_kv_slots, "slots"),
        ):
            yield gauge(f"{HISPARSE}{pool_name}_used_{unit}", f"{pool_name} {unit} in use", pool.used)
            yield gauge(f"{HISPARSE}{pool_name}_total_{unit}", f"{pool_name} {unit} in all", pool.total)
            yield gauge(f"{HISPARSE}{pool_name}_usage", f"{pool_name} fraction in use", pool.fraction)

        per_layer = (
            ("swap_in_hits", "top-k rows found in the device buffer", "hits"),
            ("swap_in_misses", "top-k rows copied host to device", "misses"),
            ("speculative_prefetch_hits", "rows a speculative prefetch found in the buffer", "speculative_hits"),
            ("speculative_prefetch_misses", "rows a speculative prefetch copied host to device",
             "speculative_misses"),
            ("bytes_h2d", "bytes copied host to device (swap-in)", "bytes_h2d"),
            ("bytes_d2h", "bytes copied device to host (backup)", "bytes_d2h"),
        )
        for name, doc, attr in per_layer:
            family = CounterMetricFamily(HISPARSE + name, doc + ", per layer", labels=["model_name", "layer"])
            for layer in stats.hisparse_layers:
                family.add_metric([m.model_name, str(layer.layer)], getattr(layer, attr))
            yield family
        saved = [layer for layer in stats.hisparse_layers if layer.speculative_rows_saved is not None]
        if saved:  # a gauge: the bets' payoff can fall (a bet that evicts rows the layer then needs)
            family = GaugeMetricFamily(
                HISPARSE + "speculative_prefetch_rows_saved",
                "rows a layer's own swap-ins did not copy thanks to the speculative prefetch's bets (its first shared "
                "follower's misses minus its own), cumulative, per layer", labels=["model_name", "layer"])
            for layer in saved:
                family.add_metric([m.model_name, str(layer.layer)], layer.speculative_rows_saved)
            yield family
        hits, misses = stats.hisparse_hits, stats.hisparse_misses
        yield gauge(
            HISPARSE + "hit_rate",
            "swap-in hits / (hits + misses), all layers",
            hits / (hits + misses) if hits + misses else 0.0,
        )
        if stats.disagg is not None:
            yield from _disagg_metrics(m.model_name, stats.disagg)
        if stats.dp_ranks:
            yield from _dp_rank_metrics(m.model_name, stats, m.dp_inflight)


def _dp_rank_metrics(model_name: str, stats: EngineStats,
                     inflight: tuple[list[int], list[int]]) -> Iterator[Metric]:  # fmt: skip
    """Data-parallel attention: each rank's load and pools (the unlabelled series above are their sums), and the
    requests and tokens the api has in flight on each rank (what its load balancing reads)."""
    labels = ["model_name", "dp_rank"]
    requests, tokens = inflight
    gauges = (
        ("dp_num_running_reqs", "requests in the rank's decode batch", lambda r: r.num_running_reqs),
        ("dp_num_queue_reqs", "requests waiting to be admitted on the rank", lambda r: r.num_queue_reqs),
        ("dp_token_usage", "fraction of the rank's binding KV pool in use", lambda r: r.token_usage),
        ("dp_host_pool_used_pages", "host pool pages in use on the rank", lambda r: r.host_pages.used),
        ("dp_device_buffer_used_slots", "device buffer slots in use on the rank", lambda r: r.device_slots.used),
        ("dp_indexer_cache_used_slots", "indexer cache slots in use on the rank", lambda r: r.indexer_slots.used),
        ("dp_dense_kv_used_slots", "dense KV slots in use on the rank", lambda r: r.dense_kv_slots.used),
        ("dp_inflight_requests", "requests the api has in flight on the rank",
         lambda r: requests[r.dp_rank] if r.dp_rank < len(requests) else 0),
        ("dp_inflight_tokens", "prompt + max_tokens of the requests the api has in flight on the rank",
         lambda r: tokens[r.dp_rank] if r.dp_rank < len(tokens) else 0),
    )  # fmt: skip
    counters = (
        ("dp_num_idle_passes", "passes the rank ran without a token of its own (idle batches)",
         lambda r: r.num_idle_passes),
        ("dp_generation_tokens", "tokens the rank generated", lambda r: r.num_generated_tokens),
        ("dp_kv_transfer_bytes", "PD decode: KV bytes that arrived into the rank", lambda r: r.kv_transfer_bytes),
    )  # fmt: skip
    for kind, series in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
        for name, doc, value in series:
            family = kind(HISPARSE + name, doc, labels=labels)
            for rank in stats.dp_ranks:
                family.add_metric([model_name, str(rank.dp_rank)], value(rank))
            yield family

def _disagg_metrics(model_name: str, d: DisaggStats) -> Iterator[Metric]:
    """PD disaggregation (docs/pd.md): SGLang's queue gauges and failure counters, plus transfer bytes, a
    transfer-latency histogram, rooms by state and failures by cause."""
    labels = [model_name]

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(SGLANG + name, doc, labels=["model_name"])
        family.add_metric(labels, value)
        return family

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(SGLANG + name, doc, labels=["model_name"])
        family.add_metric(labels, value)
        return family

    if d.mode == "prefill":
        yield gauge("num_prefill_prealloc_queue_reqs", "prefill requests waiting for decode's destination",
                    d.num_bootstrapping_reqs)
        yield gauge("num_prefill_inflight_queue_reqs", "prefilled requests whose KV is still being sent",
                    d.num_inflight_reqs)
    else:
        yield gauge("num_decode_prealloc_queue_reqs", "PD requests waiting for memory", d.num_prealloc_reqs)
        yield gauge("num_decode_transfer_queue_reqs", "PD requests waiting for their KV", d.num_transferring_reqs)
        yield gauge("pd_staging_used_rows", "host staging rows holding arrived KV (dense decode)", d.staging_rows.used)
        yield gauge("pd_aux_used_rows", "aux rows of rooms in flight", d.aux_rows_used)
    yield counter("kv_transfer_bytes", "KV bytes moved between prefill and decode (rows and aux records)",
                  d.transfer_bytes)
    yield gauge("kv_transfer_registered_bytes", "memory registered with the transfer engine", d.registered_bytes)
    yield counter("num_bootstrap_failed_reqs", "requests failed by a bootstrap timeout",
                  d.failures_by_cause.get("bootstrap_timeout", 0))
    yield counter("num_transfer_failed_reqs", "requests whose KV transfer failed (any cause)",
                  d.rooms_finished.get("FAILED", 0))
    rooms = GaugeMetricFamily(SGLANG + "kv_transfer_rooms", "rooms in flight, by state",
                              labels=["model_name", "state"])
    for state in ("BOOTSTRAPPING", "WAITING", "TRANSFERRING", "ABORTING"):
        rooms.add_metric([model_name, state.lower()], d.rooms_by_state.get(state, 0))
    yield rooms
    ended = CounterMetricFamily(SGLANG + "kv_transfer_rooms_finished", "rooms ended, by terminal state",
                                labels=["model_name", "state"])
    for state in ("SUCCESS", "FAILED", "ABORTED"):
        ended.add_metric([model_name, state.lower()], d.rooms_finished.get(state, 0))
    yield ended
    rejected = CounterMetricFamily(
        SGLANG + "kv_transfer_rejected_messages", "PD control messages and bootstrap requests refused (failed "
        "authentication, replayed, stale, malformed, oversize, from the wrong peer), by reason",
        labels=["model_name", "reason"])  # fmt: skip
    for reason, n in sorted(d.rejected_by_reason.items()):
        rejected.add_metric([model_name, reason], n)
    yield rejected
    yield gauge("kv_transfer_auth_enabled", "1 when the PD control plane is authenticated with a cluster secret",
                1.0 if d.auth else 0.0)
    failures = CounterMetricFamily(SGLANG + "kv_transfer_failures", "failed or aborted rooms, by cause",
                                   labels=["model_name", "cause"])
    for cause, n in sorted(d.failures_by_cause.items()):
        failures.add_metric([model_name, cause], n)
    yield failures
    if d.latency_bucket_counts:
        cumulative, buckets = 0, []
        bounds = [*(str(b) for b in KV_TRANSFER_LATENCY_BUCKETS), "+Inf"]
        for bound, n in zip(bounds, d.latency_bucket_counts, strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        hist = HistogramMetricFamily(SGLANG + "kv_transfer_latency_seconds",
                                     "time from a room's first write to its end (successful rooms)",
                                     labels=["model_name"])
        hist.add_metric(labels, buckets, d.latency_sum_s)
        yield hist


class ServerMetrics:
    """The api process's metrics. Handlers call `on_*`; `/metrics` calls `render` after refreshing stats."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self.latest_stats = EngineStats()
        self.dp_inflight: tuple[list[int], list[int]] = ([], [])  # per DP rank: requests, tokens in flight (api)
        self.engine_alive = True
        self.throughput = ThroughputWindow()
        labels = ["model_name"]
        self.ttft = Histogram(
            SGLANG + "time_to_first_token_seconds", "time to first token", labels,
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.itl = Histogram(
            SGLANG + "inter_token_latency_seconds", "time between consecutive tokens of a request", labels,
            buckets=_ITL_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.e2e = Histogram(
            SGLANG + "e2e_request_latency_seconds", "request latency, arrival to last token", labels,
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.requests = Counter(
            SGLANG + "num_requests", "requests finished, by finish reason", ["model_name", "finish_reason"],
            registry=self.registry,
        )  # fmt: skip
        self.rejected = Counter(
            SGLANG + "num_rejected_requests", "responses with an error status (>= 400), by status and error type",
            ["model_name", "status", "reason"], registry=self.registry,
        )  # fmt: skip
        self.registry.register(_EngineStatsCollector(self))

    def on_first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def on_tokens(self, num_tokens: int, seconds_since_previous: float | None) -> None:
        """`num_tokens` arrived together `seconds_since_previous` after the request's previous tokens."""
        self.throughput.add(num_tokens)
        if seconds_since_previous is not None and num_tokens > 0:
            per_token = seconds_since_previous / num_tokens
            for _ in range(num_tokens):
                self.itl.labels(self.model_name).observe(per_token)

    def on_finished(self, finish_reason: str, e2e_seconds: float) -> None:
        self.requests.labels(self.model_name, finish_reason).inc()
        self.e2e.labels(self.model_name).observe(e2e_seconds)

    def on_rejected(self, status: int, reason: str = "unknown") -> None:
        self.rejected.labels(self.model_name, str(status), reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
