"""The router's view of its workers: health (checked on an interval), in-flight counts and reported load.

A worker leaves the rotation after `health_failure_threshold` failed checks in a row, or at once when a request
cannot connect to it (a refused connection is unambiguous); it comes back after `health_success_threshold`
passed checks. Load (`GET /load` on our servers) is polled only for the least_load policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Literal

import aiohttp
from yarl import URL

from decode_server.router.config import RouterConfig
from decode_server.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]

# What a worker call can fail with: connection refused/reset, a broken answer, a timeout.
WORKER_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


@dataclass(eq=False)
class Worker:
    url: str
    role: Role
    bootstrap_port: int | None = None
    bootstrap_host: str | None = None
    healthy: bool = False  # unknown until the first check passes
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    inflight: int = 0  # requests this router has sent and not finished
    reported_load: int = 0  # running + waiting requests at the last GET /load
    host_pages_free: int = 0
    load_time: float = 0.0
    last_error: str = ""
    load: dict = field(default_factory=dict)
    _endpoints: dict[str, URL] = field(default_factory=dict, repr=False)

    def endpoint(self, path: str) -> URL:
        """The worker's URL for `path`, parsed once (the client would parse the string on every request)."""
        url = self._endpoints.get(path)
        if url is None:
            url = self._endpoints[path] = URL(self.url + path)
        return url

    def load_score(self) -> tuple[int, int]:
        """Lower is lighter. The worker's own count can be up to one poll old: between polls the router's own
        in-flight count (which it always knows) keeps a burst of new requests from piling onto one worker."""
        return (max(self.reported_load, self.inflight), -self.host_pages_free)


class WorkerPool:
    def __init__(self, config: RouterConfig, client: aiohttp.ClientSession, metrics: RouterMetrics) -> None:
        self.config = config
        self.client = client
        self.metrics = metrics
        self.prefill = [
            Worker(w.url, "prefill", bootstrap_port=w.bootstrap_port, bootstrap_host=w.bootstrap_host)
            for w in config.prefill
        ]
        self.decode = [Worker(w.url, "decode") for w in config.decode]
        self._tasks: list[asyncio.Task[None]] = []
        self._probe_timeout = aiohttp.ClientTimeout(total=config.health_check_timeout_secs)
        self._first_check = asyncio.Event()
        for w in self.all:
            metrics.set_health(w.role, w.url, w.healthy)

    @property
    def all(self) -> list[Worker]:
        return self.prefill + self.decode

    def healthy(self, role: Role) -> list[Worker]:
        return [w for w in (self.prefill if role == "prefill" else self.decode) if w.healthy]

    @property
    def ready(self) -> bool:
        return bool(self.healthy("prefill")) and bool(self.healthy("decode"))

    # -------------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._health_loop(), name="router-health"))
        if "least_load" in (self.config.resolved_prefill_policy, self.config.resolved_decode_policy):
            self._tasks.append(asyncio.create_task(self._load_loop(), name="router-load"))

    async def wait_first_check(self) -> None:
        await self._first_check.wait()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    # -------------------------------------------------------------------------------------- health

    async def _health_loop(self) -> None:
        while True:
            await self.check_all()
            self._first_check.set()
            await asyncio.sleep(self.config.health_check_interval_secs)

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(w) for w in self.all))

    async def _check(self, worker: Worker) -> None:
        try:
            async with self.client.get(worker.url + "/health", timeout=self._probe_timeout) as resp:
                await resp.read()
                ok, reason = resp.status == 200, f"/health answered {resp.status}"
        except WORKER_ERRORS as exc:
            ok, reason = False, f"{type(exc).__name__}: {exc}"
        if ok:
            self.record_success(worker)
        else:
            self.record_failure(worker, reason)

    def record_success(self, worker: Worker) -> None:
        worker.consecutive_failures = 0
        worker.consecutive_successes += 1
        if not worker.healthy and worker.consecutive_successes >= self.config.health_success_threshold:
            worker.healthy = True
            logger.info("%s worker %s is healthy", worker.role, worker.url)
            self.metrics.set_health(worker.role, worker.url, True)

    def record_failure(self, worker: Worker, reason: str, *, at_once: bool = False) -> None:
        """A failed check; `at_once` (a request could not even connect) takes the worker out immediately."""
        worker.consecutive_successes = 0
        worker.consecutive_failures += 1
        worker.last_error = reason
        threshold = 1 if at_once else self.config.health_failure_threshold
        if worker.healthy and worker.consecutive_failures >= threshold:
            worker.healthy = False
            logger.warning("%s worker %s leaves the rotation: %s", worker.role, worker.url, reason)
            self.metrics.set_health(worker.role, worker.url, False)

    # -------------------------------------------------------------------------------------- load

    async def _load_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._poll_load(w) for w in self.all if w.healthy))
            await asyncio.sleep(self.config.load_check_interval_secs)

    async def _poll_load(self, worker: Worker) -> None:
        try:
            async with self.client.get(worker.url + "/load", timeout=self._probe_timeout) as resp:
                resp.raise_for_status()
                load = await resp.json()
            worker.reported_load = int(load.get("num_running_reqs", 0)) + int(load.get("num_waiting_reqs", 0))
            worker.host_pages_free = int(load.get("host_pages_free", 0))
            worker.load = load
            worker.load_time = time.monotonic()
            self.metrics.set_load(worker.role, worker.url, worker.reported_load)
        except (*WORKER_ERRORS, ValueError, TypeError, AttributeError) as exc:
            logger.debug("load of %s unavailable: %s", worker.url, exc)
