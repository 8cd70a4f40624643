"""Prometheus metrics of the router (`GET /metrics`), in a registry of its own.

Names are prefixed `hisparse_router:`; worker URLs are label values, so that a dashboard shows each worker.
The per-request updates go through children cached by label values (prometheus_client's `labels()` lookup costs
more than the update itself, and the router makes about ten updates per request).

With several router processes (`--router-processes N`) every process writes its values to memory-mapped files in
one directory (prometheus_client's multiprocess mode: the supervisor creates the directory and sets
`PROMETHEUS_MULTIPROC_DIR` for its children before they import prometheus_client), and `/metrics`, whichever
process answers it, reads all of them: counters and histograms are summed over the processes, dead ones
included (a request served by a process that has exited still happened). Gauges say how they combine:
- `worker_healthy`: `livemin`, 1 only while every live process has the worker in rotation (each process checks
  the worker itself; a 0 means at least one process took it out, which is what an alert wants to see);
- `worker_inflight_requests`: `livesum`, the requests in flight through the whole router;
- `worker_load`: `livemostrecent`, the worker's last report (every process polls the same `GET /load`).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)

# Outcomes of one request at one worker.
OUTCOMES = ("success", "client_error", "server_error", "unreachable", "stream_error", "aborted", "timeout")


class RouterMetrics:
    def __init__(self, multiprocess_dir: str | None = None) -> None:
        """`multiprocess_dir`: the shared directory of all router processes (None: one process, values in
        memory). It must be the `PROMETHEUS_MULTIPROC_DIR` prometheus_client saw when it was imported."""
        self.multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "hisparse_router:requests", "requests sent to a worker, by role, worker and outcome",
            ["role", "worker", "outcome"], registry=r,
        )  # fmt: skip
        self.client_requests = Counter(
            "hisparse_router:client_requests", "client requests by route and HTTP status the client got",
            ["route", "status"], registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "hisparse_router:retries", "pairs tried again because a worker was unreachable", registry=r
        )
        self.aborts = Counter(
            "hisparse_router:aborts_sent", "POST /abort_request sent to workers after a client disconnect",
            ["role", "worker"], registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            "hisparse_router:request_latency_seconds", "client request arrival to the last byte sent",
            ["route"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttfb = Histogram(
            "hisparse_router:time_to_first_byte_seconds", "client request arrival to decode's first byte",
            ["route"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.cache_aware = Counter(
            "hisparse_router:cache_aware_decisions",
            "cache_aware prefill choices: hit (the worker that saw the prompt's start), miss (the idlest), "
            "imbalanced (the idlest, load out of balance)", ["outcome"], registry=r,
        )  # fmt: skip
        self.dispatch = Histogram(
            "hisparse_router:dispatch_overhead_seconds",
            "router work before the worker requests go out (parse, validate, pick)",
            buckets=_OVERHEAD_BUCKETS, registry=r,
        )  # fmt: skip
        self.healthy = Gauge(
            "hisparse_router:worker_healthy", "1 while the worker is in rotation (in every router process)",
            ["role", "worker"], registry=r, multiprocess_mode="livemin",
        )  # fmt: skip
        self.inflight = Gauge(
            "hisparse_router:worker_inflight_requests", "requests in flight at the worker through this router",
            ["role", "worker"], registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        self.load = Gauge(
            "hisparse_router:worker_load", "running + waiting requests the worker reported (least_load)",
            ["role", "worker"], registry=r, multiprocess_mode="livemostrecent",
        )  # fmt: skip

        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def count_request(self, role: str, url: str, outcome: str) -> None:
        self._child(self.requests, role, url, outcome).inc()

    def count_cache_aware(self, outcome: str) -> None:
        self._child(self.cache_aware, outcome).inc()

    def set_inflight(self, role: str, url: str, inflight: int) -> None:
        self._child(self.inflight, role, url).set(inflight)

    def count_client(self, route: str, status: int) -> None:
        self._child(self.client_requests, route, str(status)).inc()

    def observe_latency(self, route: str, seconds: float) -> None:
        self._child(self.latency, route).observe(seconds)

    def observe_ttfb(self, route: str, seconds: float) -> None:
        self._child(self.ttfb, route).observe(seconds)

    def set_health(self, role: str, url: str, healthy: bool) -> None:
        self.healthy.labels(role, url).set(1 if healthy else 0)

    def set_load(self, role: str, url: str, load: int) -> None:
        self.load.labels(role, url).set(load)

    def render(self) -> bytes:
        """The text format of the whole router: with several processes, of every process's files (a fresh
        registry per scrape, as prometheus_client's multiprocess documentation prescribes: the collector must not
        sit next to the metrics themselves, or each value would appear twice)."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.multiprocess_dir)
        return generate_latest(registry)
