"""Room states, failure causes and the counters both sides expose for metrics.

A room is one request's transfer, named by the router's `bootstrap_room`. States only move forward and every
room ends in exactly one terminal state (SUCCESS, FAILED or ABORTED): the first terminal transition wins and
later ones are ignored (a late failure of a finished room changes nothing).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum


class RoomState(IntEnum):
    BOOTSTRAPPING = 1  # decode: looking up / registering with prefill; prefill: no destination yet
    WAITING = 2  # decode: destination sent, waiting for the data; prefill: destination known, nothing written
    TRANSFERRING = 3  # prefill: writes queued or running
    ABORTING = 4  # decode: ABORT sent, waiting for prefill's ACK before the pages may be reused
    SUCCESS = 5
    FAILED = 6
    ABORTED = 7

    @property
    def terminal(self) -> bool:
        return self >= RoomState.SUCCESS


class FailureCause(StrEnum):
    BOOTSTRAP_TIMEOUT = "bootstrap_timeout"  # decode: prefill not reachable; prefill: decode never sent the room
    WAITING_TIMEOUT = "waiting_timeout"  # decode: the data did not arrive in time
    HEARTBEAT = "heartbeat"  # decode: prefill stopped answering heartbeats (dead peer)
    HANDSHAKE = "handshake"  # layout or protocol mismatch, or an invalid destination
    TRANSFER = "transfer"  # a transfer-engine write failed
    PEER = "peer"  # the other side failed the room and told us
    LOCAL = "local"  # our own caller failed or released the room
    CLOSED = "closed"  # the sender/receiver was closed with the room in flight
    AUTH = "auth"  # the peer failed authentication (another cluster secret, or none on one side)


@dataclass
class TransferStats:
    """Thread-safe counters. `rooms_finished` counts terminal transitions by state, `failures` by cause,
    `rejected` the control messages and bootstrap requests refused (authentication, malformed, wrong peer) by
    reason."""

    bytes_transferred: int = 0
    rooms_started: int = 0
    rooms_finished: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)
    rejected: Counter = field(default_factory=Counter)
    abort_acks_received: int = 0
    _latency: deque = field(default_factory=lambda: deque(maxlen=100_000))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def started(self) -> None:
        with self._lock:
            self.rooms_started += 1

    def finished(self, state: RoomState, cause: FailureCause | None) -> None:
        with self._lock:
            self.rooms_finished[state.name] += 1
            if cause is not None:
                self.failures[cause.value] += 1

    def reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] += 1

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self.bytes_transferred += n

    def add_latency(self, seconds: float) -> None:
        with self._lock:
            self._latency.append(seconds)

    def ack_received(self) -> None:
        with self._lock:
            self.abort_acks_received += 1

    def take_latency_samples(self) -> list[float]:
        """Latency samples (seconds, per successful room) since the last call: feed them to a histogram."""
        with self._lock:
            out = list(self._latency)
            self._latency.clear()
            return out

    def snapshot(self) -> dict:
        with self._lock:
            return {"bytes_transferred": self.bytes_transferred, "rooms_started": self.rooms_started,
                    "rooms_finished": dict(self.rooms_finished), "failures": dict(self.failures),
                    "rejected": dict(self.rejected),
                    "abort_acks_received": self.abort_acks_received}


@dataclass
class RoomBase:
    """State shared by both sides' room records; transitions go through `finish` under the owner's lock."""

    room: int
    state: RoomState = RoomState.BOOTSTRAPPING
    reason: str = ""
    cause: FailureCause | None = None
    created: float = field(default_factory=time.monotonic)
    state_since: float = field(default_factory=time.monotonic)

    def advance(self, state: RoomState) -> bool:
        if self.state.terminal or state <= self.state:
            return False
        self.state, self.state_since = state, time.monotonic()
        return True

    def finish(self, state: RoomState, reason: str = "", cause: FailureCause | None = None) -> bool:
        """Move to a terminal state; False (and no change) if the room already ended."""
        assert state.terminal
        if self.state.terminal:
            return False
        self.state, self.reason, self.cause, self.state_since = state, reason, cause, time.monotonic()
        return True


def count_by_state(rooms: Iterable[RoomBase]) -> dict[str, int]:
    """How many rooms are in each state, by state name (both sides' `num_rooms_by_state`)."""
    return dict(Counter(r.state.name for r in rooms))
