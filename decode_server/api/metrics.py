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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from decode_server.engine.types import EngineStats

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
        if num_tokens <= 0:
            return
        with self._lock:
            self._events.append((time.monotonic() if now is None else now, num_tokens))

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._events and self._events[0][0] < now - self.window_s:
                self._events.popleft()
            return sum(n for _, n in self._events) / self.window_s


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

        yield gauge(
            HISPARSE + "enabled", "1 when HiSparse (host KV pool) mode is on", float(stats.hisparse_enabled)
        )
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
            ("bytes_h2d", "bytes copied host to device (swap-in)", "bytes_h2d"),
            ("bytes_d2h", "bytes copied device to host (backup)", "bytes_d2h"),
        )
        for name, doc, attr in per_layer:
            family = CounterMetricFamily(HISPARSE + name, doc + ", per layer", labels=["model_name", "layer"])
            for layer in stats.hisparse_layers:
                family.add_metric([m.model_name, str(layer.layer)], getattr(layer, attr))
            yield family
        hits, misses = stats.hisparse_hits, stats.hisparse_misses
        yield gauge(
            HISPARSE + "hit_rate",
            "swap-in hits / (hits + misses), all layers",
            hits / (hits + misses) if hits + misses else 0.0,
        )


class ServerMetrics:
    """The api process's metrics. Handlers call `on_*`; `/metrics` calls `render` after refreshing stats."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self.latest_stats = EngineStats()
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
