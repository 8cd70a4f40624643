"""The api process's handle on the engine process: spawn it, talk to it over ZMQ, notice when it dies.

Sockets: the api binds two ipc endpoints in a private temporary directory (PUSH to the engine, PULL from it);
the engine connects. One receiver task routes each engine message: acceptances and rejections resolve the
submitter's future, token deltas go to the queue of the HTTP request that owns the rid, stats replies resolve
the stats query. A watchdog polls the child; when it is gone every waiting request fails with
`EngineDeadError` (HTTP 503) and `on_engine_death` tells the server to exit non-zero instead of hanging.

Aborts are settled on the api side at once (the rid's queue gets a final event and the route is dropped),
so a client never waits on the engine to confirm, and late deltas of an aborted rid are ignored.

With data-parallel attention (`--enable-dp-attention`) the engine is N ranks that each serve their own requests;
this client decides which rank serves each request (`--load-balance-method`, from the requests it has in flight on
each rank: it sees every request start and end), and each rank answers over the same socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from decode_server.config import EngineConfig
from decode_server.disagg.bootstrap_info import BootstrapInfo
from decode_server.engine.sampling_params import SamplingParams
from decode_server.engine.types import EngineStats, RequestDelta
from decode_server.errors import (
    DecodeServerError,
    EngineDeadError,
    EngineNotRespondingError,
    QueueFullError,
    ServerShuttingDownError,
)
from decode_server.router.prefix_affinity import PrefixAffinity
from decode_server.runtime.death_note import read_note
from decode_server.runtime.messages import (
    AbortMsg,
    AcceptedMsg,
    DeltasMsg,
    FatalMsg,
    FlushCacheMsg,
    FlushedMsg,
    GenerateMsg,
    HeartbeatMsg,
    ReadyMsg,
    RejectedMsg,
    ShutdownMsg,
    StatsMsg,
    StatsQueryMsg,
    ToEngine,
    decode_from_engine,
    encode,
)

logger = logging.getLogger(__name__)

WATCHDOG_PERIOD_S = 0.2
# How long a dead engine's last message (FatalMsg: why it died) may still be on its way after the process is gone.
# The engine sends it just before exiting, but the watchdog can see the exit before the receive loop has read it;
# without this wait the error said "exit code 1" instead of, say, which tensor-parallel rank was killed. 0.5 s was
# too short on a loaded 2-core CI machine (2026-11-27: a killed rank 1 reported as "exit code 1"), and so was 2 s with
# two test suites sharing those 2 cores (2026-11-28); the server is exiting either way, so waiting longer costs
# nothing but the wait (only when the engine died without saying why is the whole wait spent).
DEATH_REASON_GRACE_S = 5.0


@dataclass(frozen=True)
class StreamEvent:
    """What a request's queue receives: a delta of choice `index`, or the error that ends that choice."""

    index: int
    delta: RequestDelta | None = None
    error: DecodeServerError | None = None


@dataclass
class _Route:
    queue: asyncio.Queue[StreamEvent]
    index: int
    dp_rank: int = 0
    tokens: int = 0  # prompt + max_tokens: the KV it may come to hold (minimum_tokens balancing)


class DPBalancer:
    """Which data-parallel attention rank serves the next request, from the requests in flight on each rank.

    `shortest_queue` (default): the rank with the fewest requests in flight (running or waiting there), ties to the
    one with fewer tokens in flight, then the lower rank; `minimum_tokens`: the fewest tokens (prompt + max_tokens)
    in flight, ties to fewer requests; `round_robin`: in turn (SGLang's methods of the same names).

    `cache_aware` (with `--enable-prefix-caching`, where each rank caches its own prefixes): the rank that got the
    longest start of this prompt, when that start is at least half of it, so its cached pages are reused; else the
    shortest queue; while the ranks' request counts are out of balance (by more than 32 and in ratio), the shortest
    queue whatever the prefix — the PD router's cache_aware policy with SGLang's defaults, over token ids."""

    CACHE_THRESHOLD = 0.5
    BALANCE_ABS_THRESHOLD = 32
    BALANCE_REL_THRESHOLD = 1.0001
    MAX_TREE_CHARS = 2**24

    def __init__(self, dp_size: int, method: str) -> None:
        self.dp_size = dp_size
        self.method = method
        self._turn = itertools.count()
        self.affinity: PrefixAffinity[int] | None = (
            PrefixAffinity(self.MAX_TREE_CHARS) if method == "cache_aware" else None)
        self.decisions = {"hit": 0, "miss": 0, "imbalanced": 0}  # cache_aware's outcomes (tests, /server_info)

    def choose(self, routes: list[_Route], prompt_token_ids: list[int] | None = None) -> int:
        if self.dp_size == 1:
            return 0
        if self.method == "round_robin":
            return next(self._turn) % self.dp_size
        requests, tokens = self.load(routes)
        if self.method == "minimum_tokens":
            return min(range(self.dp_size), key=lambda r: (tokens[r], requests[r], r))
        shortest = min(range(self.dp_size), key=lambda r: (requests[r], tokens[r], r))
        if self.affinity is None:
            return shortest
        text = " ".join(map(str, prompt_token_ids or []))
        if (max(requests) - min(requests) > self.BALANCE_ABS_THRESHOLD
                and max(requests) > min(requests) * self.BALANCE_REL_THRESHOLD):
            choice, outcome = shortest, "imbalanced"
        else:
            owner, share = self.affinity.match(text)
            hit = owner is not None and share >= self.CACHE_THRESHOLD
            choice, outcome = (owner, "hit") if hit and owner is not None else (shortest, "miss")
        self.affinity.record(text, choice)
        self.decisions[outcome] += 1
        return choice

    def load(self, routes: list[_Route]) -> tuple[list[int], list[int]]:
        """Requests and tokens in flight per rank."""
        requests, tokens = [0] * self.dp_size, [0] * self.dp_size
        for route in routes:
            requests[route.dp_rank] += 1
            tokens[route.dp_rank] += route.tokens
        return requests, tokens


class EngineClient:
    """Owns the engine child process and the two sockets to it (use from one asyncio loop)."""

    def __init__(
        self,
        engine_config: EngineConfig,
        *,
        log_level: str = "info",
        max_inflight: int | None = None,
        on_engine_death: Callable[[], None] | None = None,
        engine_factory: str | None = None,
        heartbeat_timeout_s: float = 10.0,
    ) -> None:
        self.engine_config = engine_config
        self.engine_factory = engine_factory
        self.log_level = log_level
        # Each data-parallel attention rank runs and queues as many requests as one engine.
        self.max_inflight = max_inflight or engine_config.dp_attention_size * (
            engine_config.max_running_requests + engine_config.max_queued_requests
        )
        self.on_engine_death = on_engine_death
        self.engine_info: dict[str, Any] = {}
        self.dead = False
        self.death_reason = ""
        self.closing = False
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.watchdog_timeout_s = engine_config.watchdog_timeout
        self.last_heard = time.monotonic()  # any message from the engine
        self.step_running_s = 0.0  # from the last heartbeat
        self.unresponsive = False
        self._routes: dict[str, _Route] = {}
        self.balancer = DPBalancer(engine_config.dp_attention_size, engine_config.load_balance_method)
        self._accepts: dict[str, asyncio.Future[None]] = {}
        # Queries answered by a message of the same id: stats (StatsMsg) and prefix-cache flushes (FlushedMsg).
        self._queries: dict[int, asyncio.Future[Any]] = {}
        self._query_ids = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._process: multiprocessing.process.BaseProcess | None = None
        self._ipc_dir = tempfile.mkdtemp(prefix="decode-server-")
        self._ctx = zmq.asyncio.Context()
        self._to_engine = self._ctx.socket(zmq.PUSH)
        self._from_engine = self._ctx.socket(zmq.PULL)
        self._to_engine.setsockopt(zmq.LINGER, 0)
        self._from_engine.setsockopt(zmq.LINGER, 0)
        self.to_engine_addr = f"ipc://{self._ipc_dir}/to_engine"
        self.from_engine_addr = f"ipc://{self._ipc_dir}/from_engine"
        self._to_engine.bind(self.to_engine_addr)
        self._from_engine.bind(self.from_engine_addr)

    # ------------------------------------------------------------------------------------------ lifecycle

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def num_inflight(self) -> int:
        return len(self._routes)

    async def start(self, ready_timeout_s: float = 600.0) -> dict[str, Any]:
        """Spawn the engine process and wait until it has loaded the model; returns its `ReadyMsg.info`."""
        from decode_server.runtime.engine_process import DEFAULT_ENGINE_FACTORY, run_engine_process

        ctx = multiprocessing.get_context("spawn")
        self._process = ctx.Process(
            target=run_engine_process,
            name="decode-server-engine",
            args=(
                self.engine_config,
                self.to_engine_addr,
                self.from_engine_addr,
                os.getpid(),
                self.log_level,
                self.engine_factory or DEFAULT_ENGINE_FACTORY,
            ),  # fmt: skip
            daemon=True,
        )
        self._process.start()
        logger.info("engine process started (pid %d), loading model %s", self._process.pid,
                    self.engine_config.model_path)  # fmt: skip
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if not self._process.is_alive():
                raise EngineDeadError(
                    f"engine process exited during start-up (exit code {self._process.exitcode})"
                )
            if time.monotonic() > deadline:
                self._kill_process()
                raise EngineDeadError(f"engine process not ready after {ready_timeout_s:.0f} s")
            if await self._from_engine.poll(timeout=200):
                msg = decode_from_engine(await self._from_engine.recv())
                if isinstance(msg, ReadyMsg):
                    self.engine_info = dict(msg.info)
                    self.last_heard = time.monotonic()
                    break
                if isinstance(msg, FatalMsg):
                    self._process.join(timeout=5)
                    raise EngineDeadError(f"engine failed to start: {msg.message}")
                logger.warning("ignoring %s received before the engine was ready", type(msg).__name__)
        self._tasks = [
            asyncio.create_task(self._receive_loop(), name="engine-receiver"),
            asyncio.create_task(self._watchdog(), name="engine-watchdog"),
        ]
        return self.engine_info

    async def shutdown(self, reason: str = "server shutting down", timeout_s: float = 10.0) -> int | None:
        """Abort everything, ask the engine to exit, reap it (kill after `timeout_s`). Returns its exit code."""
        self.closing = True
        self.fail_all(ServerShuttingDownError(f"request aborted: {reason}"))
        if self._process is not None and self._process.is_alive():
            with contextlib.suppress(zmq.ZMQError, EngineDeadError, TimeoutError):
                await asyncio.wait_for(self._send(ShutdownMsg(reason)), timeout_s)
            deadline = time.monotonic() + timeout_s
            while self._process.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self._process.is_alive():
                logger.warning("engine process did not exit within %.0f s; killing it", timeout_s)
                self._kill_process()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        self.close_sockets()
        return self._process.exitcode if self._process is not None else None

    def close_sockets(self) -> None:
        self._to_engine.close(linger=0)
        self._from_engine.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def _kill_process(self) -> None:
        if self._process is None:
            return
        self._process.kill()
        self._process.join(timeout=5)

    # ------------------------------------------------------------------------------------------ requests

    async def submit(
        self, rid: str, prompt_token_ids: list[int], params: SamplingParams, queue: asyncio.Queue[StreamEvent],
        index: int = 0, bootstrap: BootstrapInfo | None = None,
    ) -> None:  # fmt: skip
        """Hand one request to the engine; returns once the engine accepted it (raises its typed error if not).

        Afterwards `queue` receives this rid's deltas as `StreamEvent(index, delta)` until one is finished.
        """
        self._check_available()
        if len(self._routes) >= self.max_inflight:
            raise QueueFullError(
                f"server is at capacity ({self.max_inflight} requests running or waiting); retry later"
            )
        if rid in self._routes:
            raise DecodeServerError(f"duplicate request id {rid!r}")
        accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        dp_rank = self.balancer.choose(list(self._routes.values()), prompt_token_ids)
        self._accepts[rid] = accepted
        self._routes[rid] = _Route(queue, index, dp_rank, len(prompt_token_ids) + params.max_tokens)
        try:
            await self._send(GenerateMsg(rid, list(prompt_token_ids), params, bootstrap, dp_rank))
            await accepted
        except BaseException:
            self._routes.pop(rid, None)
            self._accepts.pop(rid, None)
            raise

    def dp_load(self) -> tuple[list[int], list[int]]:
        """Requests and tokens (prompt + max_tokens) in flight on each data-parallel attention rank."""
        return self.balancer.load(list(self._routes.values()))

    def abort_nowait(self, rid: str, reason: str = "aborted") -> bool:
        """Abort one request without awaiting (usable from `finally` of a cancelled handler): its queue gets
        a final `finish_reason='abort'` delta and the engine is told to free it. False if unknown."""
        route = self._routes.pop(rid, None)
        if route is None:
            return False
        route.queue.put_nowait(
            StreamEvent(
                route.index, RequestDelta(rid=rid, finished=True, finish_reason="abort", error=reason)
            )
        )
        if not self.dead and not self._to_engine.closed:
            # A non-blocking send completes at once; if the engine cannot take it (it is gone), there is
            # nothing left to free there.
            with contextlib.suppress(zmq.ZMQError):
                sent = self._to_engine.send(encode(AbortMsg(rid)), flags=zmq.NOBLOCK)
                if sent.done() and sent.exception() is not None:
                    logger.warning("could not send the abort of %s to the engine: %s", rid, sent.exception())
        return True

    async def abort(self, rid: str, reason: str = "aborted") -> bool:
        return self.abort_nowait(rid, reason)

    async def abort_all(self, reason: str = "aborted") -> int:
        rids = list(self._routes)
        for rid in rids:
            await self.abort(rid, reason)
        return len(rids)

    def fail_all(self, error: DecodeServerError, abort_in_engine: bool = False) -> None:
        """End every waiting request with `error` (engine death, shutdown, unresponsive engine). With
        `abort_in_engine` their aborts are queued for the engine, which frees them when it runs again."""
        rids = list(self._routes) + [rid for rid in self._accepts if rid not in self._routes]
        for rid, route in list(self._routes.items()):
            route.queue.put_nowait(StreamEvent(route.index, error=error))
            self._routes.pop(rid, None)
        for fut in list(self._accepts.values()):
            if not fut.done():
                fut.set_exception(error)
        self._accepts.clear()
        if abort_in_engine and not self.dead and not self._to_engine.closed:
            for rid in rids:
                with contextlib.suppress(zmq.ZMQError):
                    self._to_engine.send(encode(AbortMsg(rid)), flags=zmq.NOBLOCK)
        for fut in list(self._queries.values()):
            if not fut.done():
                fut.set_exception(error)
        self._queries.clear()

    async def get_stats(self, timeout_s: float = 5.0) -> EngineStats:
        return await self._query(StatsQueryMsg, timeout_s)

    async def flush_cache(self, timeout_s: float = 5.0) -> int:
        """Drop the prefix cache's pages no request maps (/flush_cache); the tokens dropped (0: caching off)."""
        return await self._query(FlushCacheMsg, timeout_s)

    async def _query(self, make_msg: Callable[[int], ToEngine], timeout_s: float) -> Any:
        """Send `make_msg(query_id)` and wait for the engine's answer of the same id."""
        self._check_available()
        query_id = next(self._query_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queries[query_id] = fut
        try:
            await self._send(make_msg(query_id))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._queries.pop(query_id, None)

    def _check_available(self) -> None:
        if self.dead:
            raise EngineDeadError(
                f"engine process is not running ({self.death_reason}); the server is exiting"
            )
        if self.closing:
            raise ServerShuttingDownError("server is shutting down; not accepting new requests")
        if self.unresponsive:
            raise EngineNotRespondingError(self._silence_message())

    def silence_s(self) -> float:
        return time.monotonic() - self.last_heard

    def _silence_message(self) -> str:
        return (f"engine process not responding (no heartbeat for {self.silence_s():.1f} s; it is restarted after "
                f"{self.watchdog_timeout_s:.0f} s)")

    async def _send(self, msg: ToEngine) -> None:
        """Send without ever blocking on a vanished engine (a PUSH socket with no peer would wait forever)."""
        data = encode(msg)
        while True:
            try:
                await self._to_engine.send(data, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                if self.dead or self._process is None or not self._process.is_alive():
                    raise EngineDeadError("engine process is not running; the server is exiting") from None
                await asyncio.sleep(0.005)

    # ------------------------------------------------------------------------------------------ background

    def _check_heartbeat(self) -> None:
        if self.closing or self.dead or self._process is None:
            return
        silence = self.silence_s()
        if silence > self.watchdog_timeout_s:
            logger.error("engine process (pid %s) silent for %.0f s (watchdog timeout %.0f s): killing it",
                         self._process.pid, silence, self.watchdog_timeout_s)  # fmt: skip
            self.death_reason = f"killed by the watchdog after {silence:.0f} s without a heartbeat"
            self._process.kill()
            self._process.join(timeout=5)
            return
        if silence > self.heartbeat_timeout_s and not self.unresponsive:
            self.unresponsive = True
            logger.error("engine process (pid %s) silent for %.1f s; failing %d in-flight request(s)",
                         self._process.pid, silence, len(self._routes))  # fmt: skip
            self.fail_all(EngineNotRespondingError(self._silence_message()), abort_in_engine=True)

    async def _receive_loop(self) -> None:
        while True:
            try:
                msg = decode_from_engine(await self._from_engine.recv())
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError:
                return
            except Exception:
                logger.exception("dropping an engine message that could not be decoded")
                continue
            self.last_heard = time.monotonic()
            self._dispatch(msg)

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, HeartbeatMsg):
            self.step_running_s = msg.step_running_s
            if self.unresponsive:
                self.unresponsive = False
                logger.warning("engine process responds again (heartbeat after a silence)")
        elif isinstance(msg, DeltasMsg):
            for delta in msg.deltas:
                route = self._routes.get(delta.rid)
                if route is None:
                    continue  # aborted here already
                if delta.finished:
                    self._routes.pop(delta.rid, None)
                route.queue.put_nowait(StreamEvent(route.index, delta))
        elif isinstance(msg, AcceptedMsg | RejectedMsg):
            fut = self._accepts.pop(msg.rid, None)
            if fut is None or fut.done():
                return
            if isinstance(msg, AcceptedMsg):
                fut.set_result(None)
            else:
                fut.set_exception(msg.to_exception())
        elif isinstance(msg, StatsMsg | FlushedMsg):
            fut = self._queries.get(msg.query_id)
            if fut is not None and not fut.done():
                fut.set_result(msg.stats if isinstance(msg, StatsMsg) else msg.dropped_tokens)
        elif isinstance(msg, FatalMsg):
            logger.error("engine process reported a fatal error: %s", msg.message)
            self.death_reason = msg.message
        else:
            logger.warning("unexpected engine message %s", type(msg).__name__)

    async def _watchdog(self) -> None:
        assert self._process is not None
        while self._process.is_alive():
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            self._check_heartbeat()
        if self.closing:
            return
        deadline = time.monotonic() + DEATH_REASON_GRACE_S
        while not self.death_reason and time.monotonic() < deadline:
            # The receive loop may still deliver the engine's FatalMsg; the note written before the exit says the
            # same where the message was lost with the process (decode_server/runtime/death_note.py).
            note = read_note(self.from_engine_addr)
            if note:
                self.death_reason = note
                break
            await asyncio.sleep(0.01)
        self.dead = True
        code = self._process.exitcode
        self.death_reason = self.death_reason or f"exit code {code}"
        logger.error("engine process (pid %s) died: %s; failing %d in-flight request(s)", self._process.pid,
                     self.death_reason, len(self._routes))  # fmt: skip
        self.fail_all(EngineDeadError(f"engine process died ({self.death_reason}); the server is exiting"))
        if self.on_engine_death is not None:
            self.on_engine_death()
