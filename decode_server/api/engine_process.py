"""The engine process: wraps `Engine` in a loop fed by ZMQ and dies with its parent.

Loop: drain every waiting api message (new requests, aborts, stats queries, shutdown) → one `Engine.step()` if
any request is unfinished → send that step's deltas in one message. While idle it blocks on the socket (100 ms
at a time, so that a vanished parent is noticed). With overlap scheduling (on by default on CUDA) a step returns
once it has launched the next pass and read the previous one, so sending the deltas and taking new messages happen
while the device computes. Each request is acknowledged (`AcceptedMsg`) or refused with
the engine's typed error (`RejectedMsg`) before any of its deltas, so the api can answer 400/503 instead of
opening a stream.

Started with multiprocessing's spawn method (a fresh interpreter: CUDA and forked torch threads do not mix).
It must not outlive the api process: Linux's parent-death signal kills it if the parent dies abruptly, and
the loop also exits when its parent pid changes.

With `--tp-size N` this process is rank 0 of N engine processes; decode_server/api/tp_ranks.py runs it.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import zmq

from decode_server.api.messages import (
    AbortMsg,
    AcceptedMsg,
    DeltasMsg,
    FatalMsg,
    GenerateMsg,
    HeartbeatMsg,
    ReadyMsg,
    RejectedMsg,
    ShutdownMsg,
    StatsMsg,
    StatsQueryMsg,
    ToEngine,
    decode_to_engine,
    encode,
)
from decode_server.config import EngineConfig

logger = logging.getLogger("decode_server.engine_process")

DEFAULT_ENGINE_FACTORY = "decode_server.engine.engine:Engine"
IDLE_POLL_MS = 100
HEARTBEAT_PERIOD_S = 0.5
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL us when the api process dies, however it dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _load_factory(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def describe_engine(engine: Any, config: EngineConfig, role: Any = None) -> dict[str, Any]:
    """What the api logs at start-up and serves in /v1/models: mode, device, context length, memory budgets."""
    from decode_server.model import resolve_model_path

    info: dict[str, Any] = {
        "model_path": config.model_path,
        "model_dir": str(resolve_model_path(config.model_path)),
        "mode": "hisparse" if config.enable_hisparse else "dense",
        "kv_cache_dtype": config.kv_cache_dtype,
        "max_running_requests": config.max_running_requests,
        "max_queued_requests": config.max_queued_requests,
        "disaggregation_mode": config.disaggregation.mode,
    }
    if role is not None:
        info["disaggregation"] = role.describe()
    for attr in ("context_length", "max_request_tokens", "device", "kv_dtype", "model_dtype"):
        value = getattr(engine, attr, None)
        if value is not None:
            info[attr] = value if isinstance(value, int | float | str | bool) else str(value)
    model_config = getattr(engine, "model_config", None)
    for attr in ("vocab_size", "num_hidden_layers", "index_topk"):
        value = getattr(model_config, attr, None)
        if isinstance(value, int):
            info[attr] = value
    stats = engine.stats()
    info["pools"] = {
        "host_pages": stats.host_pages.total,
        "device_slots": stats.device_slots.total,
        "indexer_slots": stats.indexer_slots.total,
        "dense_kv_slots": stats.dense_kv_slots.total,
    }
    info["memory"] = _memory_budgets(engine, config, stats)
    return info


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.3f} GiB"


def _memory_budgets(engine: Any, config: EngineConfig, stats: Any) -> dict[str, str]:
    """Bytes behind each pool, from its size in tokens (rows of every layer; indexer keys of the layers that run
    the indexer, 132 B each)."""
    geometry = engine.cache_geometry
    layers = geometry.num_layers
    row_bytes = geometry.row_bytes(engine.kv_dtype)
    index_bytes = geometry.num_index_layers * geometry.index_key_bytes
    if config.enable_hisparse:
        host_tokens = stats.host_pages.total * config.page_size
        return {
            "host_kv": f"{_gib(host_tokens * layers * row_bytes)} ({host_tokens} tokens)",
            "device_buffers": f"{_gib(stats.device_slots.total * layers * row_bytes)} "
            f"({stats.device_slots.total} slots)",
            "indexer_keys": f"{_gib(stats.indexer_slots.total * index_bytes)} "
            f"({stats.indexer_slots.total} tokens)",
        }
    tokens = stats.dense_kv_slots.total
    return {"device_kv": f"{_gib(tokens * geometry.bytes_per_token(engine.kv_dtype))} ({tokens} tokens)"}


class EngineLoop:
    """The loop body, separate from process set-up so that it can be driven in tests."""

    def __init__(self, engine: Any, pull: zmq.Socket, push: zmq.Socket, parent_pid: int | None,
                 role: Any = None) -> None:
        self.engine = engine
        self.role = role  # PD disaggregation (decode_server/disagg/): prefill or decode role, None = colocated
        self.pull = pull
        self.push = push
        self.parent_pid = parent_pid
        self.active: set[str] = set()
        self.stopping = False
        self.num_loops = 0  # read by the heartbeat thread
        self.step_started: float | None = None  # monotonic time the running step began; None between steps

    def run(self) -> None:
        while not self.stopping:
            self.num_loops += 1
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                logger.warning("api process %d is gone; engine exiting", self.parent_pid)
                return
            self._receive()
            if self.stopping:
                break
            if self.role is not None or self.engine.has_unfinished_requests():
                self.step_started = time.monotonic()
                try:
                    deltas = self.role.step() if self.role is not None else self.engine.step()
                finally:
                    self.step_started = None
                if deltas:
                    self._on_deltas(deltas)

    def _poll_timeout_ms(self) -> int:
        if self.role is not None:
            return self.role.poll_timeout_ms(IDLE_POLL_MS)
        return 0 if self.engine.has_unfinished_requests() else IDLE_POLL_MS

    def _receive(self) -> None:
        """Take every waiting api message (blocking up to the poll timeout while idle) and apply it."""
        if self.pull.poll(self._poll_timeout_ms()):
            self._drain()

    def _on_deltas(self, deltas: list[Any]) -> None:
        for delta in deltas:
            if delta.finished:
                self.active.discard(delta.rid)
        self.push.send(encode(DeltasMsg(list(deltas))))

    def _drain(self) -> None:
        while True:
            try:
                data = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(decode_to_engine(data))

    def _handle(self, msg: ToEngine) -> None:
        if isinstance(msg, GenerateMsg):
            try:
                if self.role is not None:
                    self.role.add_request(msg.rid, msg.prompt_token_ids, msg.params, msg.bootstrap)
                else:
                    self.engine.add_request(msg.rid, msg.prompt_token_ids, msg.params)
            except Exception as exc:  # every failure to add becomes the client's error, not ours
                logger.info("rejected request %s: %s", msg.rid, exc)
                self.push.send(encode(RejectedMsg.from_exception(msg.rid, exc)))
            else:
                self.active.add(msg.rid)
                self.push.send(encode(AcceptedMsg(msg.rid)))
        elif isinstance(msg, AbortMsg):
            rids = list(self.active) if msg.rid is None else [msg.rid]
            for rid in rids:
                self._abort(rid)
                self.active.discard(rid)
        elif isinstance(msg, StatsQueryMsg):
            self.push.send(encode(StatsMsg(msg.query_id, self._stats())))
        elif isinstance(msg, ShutdownMsg):
            logger.info("engine shutting down (%s); aborting %d request(s)", msg.reason, len(self.active))
            for rid in list(self.active):
                self._abort(rid)
            self.active.clear()
            self.stopping = True

    def _stats(self) -> Any:
        return self.role.stats() if self.role is not None else self.engine.stats()

    def _abort(self, rid: str) -> None:
        if self.role is not None:
            self.role.abort(rid)
        else:
            self.engine.abort_request(rid)


class Heartbeat(threading.Thread):
    """Reports loop progress to the api every `HEARTBEAT_PERIOD_S` on its own socket (ZMQ sockets are not
    thread-safe), and ends the process when one step has run longer than `watchdog_timeout` (SGLang's watchdog):
    a stuck step must not leave a pod that looks alive. SIGSTOP stops this thread too, so the api reads any
    silence as "stopped or hung" and has its own watchdog for that case."""

    def __init__(self, ctx: zmq.Context, address: str, loop: EngineLoop, watchdog_timeout: float) -> None:
        super().__init__(name="engine-heartbeat", daemon=True)
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 16)
        self.socket.connect(address)
        self.loop = loop
        self.watchdog_timeout = watchdog_timeout
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop.wait(HEARTBEAT_PERIOD_S):
                started = self.loop.step_started
                running = time.monotonic() - started if started is not None else 0.0
                if running > self.watchdog_timeout:
                    logger.error("engine step running for %.0f s (watchdog timeout %.0f s); exiting", running,
                                 self.watchdog_timeout)  # fmt: skip
                    with contextlib.suppress(zmq.ZMQError):
                        self.socket.send(encode(FatalMsg(f"watchdog: one engine step ran for {running:.0f} s")),
                                         zmq.NOBLOCK)  # fmt: skip
                    time.sleep(0.2)
                    os._exit(3)
                with contextlib.suppress(zmq.ZMQError):
                    self.socket.send(encode(HeartbeatMsg(os.getpid(), self.loop.num_loops, running)), zmq.NOBLOCK)
        finally:
            self.socket.close(linger=0)


def run_with_heartbeat(loop: EngineLoop, ctx: zmq.Context, address: str, watchdog_timeout: float) -> None:
    """Run an engine loop (a single engine's or TP rank 0's driver) with its heartbeat thread, which is stopped
    and joined however the loop ends."""
    heartbeat = Heartbeat(ctx, address, loop, watchdog_timeout)
    heartbeat.start()
    try:
        loop.run()
    finally:
        heartbeat.stop.set()
        heartbeat.join(timeout=2)


def run_engine_process(
    config: EngineConfig,
    to_engine_addr: str,
    from_engine_addr: str,
    parent_pid: int,
    log_level: str = "info",
    engine_factory: str = DEFAULT_ENGINE_FACTORY,
) -> None:
    """Process entry point (spawned by `EngineClient.start`)."""
    _die_with_parent()
    # The api process owns Ctrl-C: it asks us to stop over the socket, so a terminal's SIGINT to the whole
    # process group must not kill the engine mid-step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s engine %(name)s: %(message)s", force=True
    )
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    pull.connect(to_engine_addr)
    push.connect(from_engine_addr)
    if config.tp_size > 1:
        from decode_server.api.tp_ranks import run_driver_process

        # Rank 0 of a tensor-parallel group: launches and supervises the other ranks (decode_server/api/tp_ranks.py).
        exit_code = run_driver_process(config, ctx, pull, push, from_engine_addr, parent_pid, log_level,
                                       engine_factory)
        sys.exit(exit_code)
    exit_code = 0
    role = None
    try:
        engine = _load_factory(engine_factory)(config)
        if config.disaggregation.enabled:
            from decode_server.disagg.role import build_role

            role = build_role(engine, config.disaggregation)
        push.send(encode(ReadyMsg(os.getpid(), describe_engine(engine, config, role))))
        run_with_heartbeat(EngineLoop(engine, pull, push, parent_pid, role), ctx, from_engine_addr,
                           config.watchdog_timeout)
    except Exception as exc:
        logger.exception("engine process failed")
        with contextlib.suppress(zmq.ZMQError):
            push.send(encode(FatalMsg(f"{type(exc).__name__}: {exc}")))
        exit_code = 1
    finally:
        if role is not None:
            with contextlib.suppress(Exception):
                role.close()
        push.close(linger=1000)
        pull.close(linger=0)
        ctx.term()
    sys.exit(exit_code)
