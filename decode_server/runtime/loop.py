"""The engine loop: api messages in, engine steps, token deltas out (one engine, or one rank's view of a group).

Loop: drain every waiting api message (new requests, aborts, stats queries, shutdown) → one `Engine.step()` if
any request is unfinished → send that step's deltas in one message. While idle it blocks on the socket (100 ms
at a time, so that a vanished parent is noticed). With overlap scheduling (on by default on CUDA) a step returns
once it has launched the next pass and read the previous one, so sending the deltas and taking new messages happen
while the device computes. Each request is acknowledged (`AcceptedMsg`) or refused with the engine's typed error
(`RejectedMsg`) before any of its deltas, so the api can answer 400/503 instead of opening a stream.

A PD role (decode_server/disagg/), when there is one, stands between the loop and the engine: requests, aborts,
steps and stats go through it. Rank groups (decode_server/runtime/tp_ranks.py) subclass the loop to change where
messages come from (`_receive`) and what a stats query gathers (`_stats`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import zmq

from decode_server.runtime.messages import (
    AbortMsg,
    AcceptedMsg,
    DeltasMsg,
    FlushCacheMsg,
    FlushedMsg,
    GenerateMsg,
    RejectedMsg,
    ShutdownMsg,
    StatsMsg,
    StatsQueryMsg,
    ToEngine,
    decode_to_engine,
    encode,
)

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 100


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
            if self._should_step():
                self.step_started = time.monotonic()
                try:
                    deltas = self.role.step() if self.role is not None else self.engine.step()
                finally:
                    self.step_started = None
                if deltas:
                    self._on_deltas(deltas)

    def _should_step(self) -> bool:
        """Whether this iteration calls `step()`: with a PD role (it polls its transfers) or unfinished requests."""
        return self.role is not None or self.engine.has_unfinished_requests()

    def group_info(self) -> dict[str, Any]:
        """What a rank group's loop adds to the engine's ready report (nothing for a single engine)."""
        return {}

    def close(self) -> None:
        """Release what the loop owns besides the api sockets (a rank group's loop: its role, its own socket)."""

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
        elif isinstance(msg, FlushCacheMsg):
            self.push.send(encode(FlushedMsg(msg.query_id, self.engine.flush_prefix_cache())))
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
