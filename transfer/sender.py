"""KV sender (prefill side): learns each room's destination from decode and writes the rows into decode's memory.

Threads: a listener (control messages from decode receivers) and one writer (mooncake batch writes). The caller's
`send_rows` only queues a job, so the transfer of a chunk overlaps the computation of the next one; jobs of a
room whose destination has not arrived yet wait in the room and are queued when it does. One writer thread keeps
the jobs of a room in order and gives a simple guarantee: when a room fails or is aborted, the ABORT / ABORT_ACK
/ STATUS that tells decode is sent from the writer after every earlier job, so nothing is still being written
into decode's pages when decode hears of it.

Who may steer a room: a destination (ROOM) is taken only from the endpoint its receiver registered from, the first
destination of a room wins (a second one is refused), and an ABORT of a room is taken only from the endpoint of
the receiver that owns it. With a cluster secret (`auth`) every control message is authenticated as well
(transfer/channel.py), so only a decode server of the same deployment can register or name a destination.
Refusals are logged once and counted in `stats.rejected`. SUCCESS carries the digest of the destination written.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from transfer.auth import PDAuth
from transfer.bootstrap import BootstrapClient, BootstrapUnavailable
from transfer.channel import ControlChannel
from transfer.errors import TransferError
from transfer.layout import TransferLayout
from transfer.messages import (
    ALL_REGIONS,
    Abort,
    AbortAck,
    Register,
    RegisterReply,
    RoomRequest,
    Status,
    destination_digest,
)
from transfer.mooncake_transport import MooncakeTransport
from transfer.regions import MemoryRegion, coalesce_runs, run_entries
from transfer.rooms import FailureCause, RoomBase, RoomState, TransferStats, count_by_state

logger = logging.getLogger(__name__)


class RoomEventKind(StrEnum):
    READY = "ready"  # decode's destination arrived: the room can be written
    SUCCESS = "success"  # every row and the aux record are written and decode was told: free the source rows
    FAILED = "failed"
    ABORTED = "aborted"  # decode aborted the room


@dataclass(frozen=True)
class RoomEvent:
    room: int
    kind: RoomEventKind
    reason: str = ""


@dataclass
class _Receiver:
    """A registered decode receiver."""

    receiver_id: str  # its transfer session id
    endpoint: str  # its ZMQ PULL endpoint
    regions: dict[str, MemoryRegion]
    aux: MemoryRegion


@dataclass
class _Room(RoomBase):
    dest: RoomRequest | None = None
    digest: bytes = b""  # destination_digest(dest), sent with SUCCESS
    receiver: _Receiver | None = None
    pending: list[tuple] = field(default_factory=list)  # jobs queued before the destination arrived
    tokens_queued: int = 0
    finish_queued: bool = False
    first_write: float | None = None
    bytes: int = 0
    notify: str | None = None  # the failure decode must hear of (sent once, from the writer)


class KVSender:
    def __init__(
        self,
        transport: MooncakeTransport,
        layout: TransferLayout,
        src_regions: Sequence[MemoryRegion] | Mapping[str, MemoryRegion],
        bootstrap: tuple[str, int],
        zmq_host: str,
        bootstrap_timeout_s: float = 300.0,
        rank: int = 0,
        dead_receiver_ttl_s: float = 10.0,
        auth: PDAuth | None = None,
    ) -> None:
        regions = dict(src_regions) if isinstance(src_regions, Mapping) else {r.name: r for r in src_regions}
        got = {n: r.row_bytes for n, r in regions.items()}
        if got != layout.regions:
            raise ValueError(f"source regions {got} do not match the layout's regions {layout.regions}")
        for r in regions.values():
            if r.num_layers != layout.num_layers:
                raise ValueError(f"region {r.name!r} has {r.num_layers} layers, the layout {layout.num_layers}")
        self.transport, self.layout, self.regions = transport, layout, regions
        self.bootstrap_timeout_s = bootstrap_timeout_s
        # after a failed write to a decode receiver, its other rooms fail fast for this long (a dead peer would
        # otherwise cost every room a failed connection or a transfer timeout); then it is tried again, so one
        # transient failure does not cut the pair off for good
        self.dead_receiver_ttl_s = dead_receiver_ttl_s
        self.rank = rank
        self.stats = TransferStats()
        self._lock = threading.RLock()
        self._rooms: dict[int, _Room] = {}
        self._early: dict[int, tuple[RoomRequest | str, float]] = {}  # room -> (destination | abort reason, t)
        self._gone: dict[int, tuple[str, float]] = {}  # released before decode's destination came: (reason, t)
        self._receivers: dict[str, _Receiver] = {}
        self._dead_receivers: dict[str, tuple[str, float]] = {}  # receiver id -> (why writes failed, when)
        self._events: deque[RoomEvent] = deque()
        self._jobs: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._registered: list[int] = []
        # the aux record must be written from registered memory: one staging row (one writer thread)
        self._aux_staging = np.zeros(max(1, layout.aux_bytes), dtype=np.uint8)
        try:
            for r in regions.values():
                transport.register(r.base_ptr, r.nbytes)
                self._registered.append(r.base_ptr)
            transport.register(self._aux_staging.ctypes.data, self._aux_staging.nbytes)
            self._registered.append(self._aux_staging.ctypes.data)
            self._channel = ControlChannel(zmq_host, auth, on_reject=self.stats.reject)
        except Exception:
            self._unregister_all()
            raise
        self._listener = threading.Thread(target=self._listen, name="kv-sender-listen", daemon=True)
        self._writer = threading.Thread(target=self._write_loop, name="kv-sender-write", daemon=True)
        self._listener.start()
        self._writer.start()
        self._bootstrap = BootstrapClient(*bootstrap, auth=auth)
        self._register_with_bootstrap()

    # ---- public API ---------------------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return self._channel.endpoint

    def expect_room(self, room: int) -> None:
        """A prefill request for `room` arrived; its destination may already be here or come later."""
        with self._lock:
            if room in self._rooms:
                raise ValueError(f"room {room} is already in flight on this sender")
            r = _Room(room)
            self._rooms[room] = r
            self.stats.started()
            early, _ = self._early.pop(room, (None, 0.0))
            if isinstance(early, str):
                self._end(r, RoomState.ABORTED, f"aborted by decode before prefill started: {early}",
                          FailureCause.PEER, event=RoomEventKind.ABORTED)
            elif early is not None:
                self._accept_destination(r, early)

    def send_rows(self, room: int, src_rows: Sequence[int], token_start: int) -> None:
        """Queue the writes of tokens [token_start, token_start + len(src_rows)) of every region and layer.

        Returns at once. The source rows must hold their final values (e.g. after a CUDA stream sync) and stay
        untouched until the room ends (SUCCESS / FAILED / ABORTED event or `fail`). A room that already ended
        ignores the call.
        """
        rows = np.asarray(src_rows, dtype=np.int64)
        with self._lock:
            r = self._room(room)
            if r.state.terminal:
                return
            if r.finish_queued:
                raise ValueError(f"room {room}: send_rows after finish")
            r.tokens_queued += len(rows)
            self._queue(r, ("write", room, rows, int(token_start)))

    def finish(self, room: int, aux: bytes) -> None:
        """After all rows: write the aux record, then tell decode SUCCESS (the room then reports SUCCESS)."""
        if len(aux) > self.layout.aux_bytes:
            raise ValueError(f"aux record of {len(aux)} bytes exceeds the layout's {self.layout.aux_bytes}")
        with self._lock:
            r = self._room(room)
            if r.state.terminal:
                return
            if r.finish_queued:
                raise ValueError(f"room {room}: finish called twice")
            r.finish_queued = True
            self._queue(r, ("finish", room, bytes(aux)))

    def fail(self, room: int, reason: str) -> bool:
        """Fail the room from our side (e.g. its prefill request failed); decode gets ABORT with the reason once
        nothing is in flight. No event is reported for it. False if the room had already ended or is unknown."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                return False
            return self._end(r, RoomState.FAILED, reason, FailureCause.LOCAL, event=None, notify=reason)

    def release(self, room: int) -> None:
        """Forget the room (after its terminal event, or to give it up: it is then failed first)."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                return
            if not r.state.terminal:
                self._end(r, RoomState.FAILED, "released by prefill before completion", FailureCause.LOCAL,
                          event=None, notify="prefill released the room before completion")
            if r.dest is None and r.state != RoomState.SUCCESS:
                # decode's destination may still come: answer it with the failure instead of leaving it waiting
                self._gone[room] = (r.notify or r.reason, time.monotonic())
            del self._rooms[room]

    def poll(self) -> list[RoomEvent]:
        """Events since the last poll; also applies the bootstrap timeout (rooms without a destination)."""
        now = time.monotonic()
        with self._lock:
            for r in list(self._rooms.values()):
                if r.state == RoomState.BOOTSTRAPPING and now - r.created > self.bootstrap_timeout_s:
                    self._end(r, RoomState.FAILED,
                              f"bootstrap timeout: decode did not send room {r.room}'s destination within "
                              f"{self.bootstrap_timeout_s:g}s", FailureCause.BOOTSTRAP_TIMEOUT)
            for table in (self._early, self._gone):
                for room, (_, t) in list(table.items()):
                    if now - t > self.bootstrap_timeout_s:
                        del table[room]
            events = list(self._events)
            self._events.clear()
        return events

    def num_rooms_by_state(self) -> dict[str, int]:
        with self._lock:
            return count_by_state(self._rooms.values())

    def close(self) -> None:
        """Fail rooms in flight, stop the threads, leave the bootstrap table, unregister our buffers."""
        with self._lock:
            for r in self._rooms.values():
                self._end(r, RoomState.FAILED, "prefill sender closed", FailureCause.CLOSED, event=None,
                          notify="prefill sender closed")
        self._jobs.put(None)
        self._writer.join(30)
        self._stop.set()
        self._listener.join(5)
        with contextlib.suppress(BootstrapUnavailable):  # the bootstrap server may already be gone
            self._bootstrap.unregister(self.rank)
        self._channel.close()
        self._unregister_all()

    # ---- internals ----------------------------------------------------------------------------------------------

    def _unregister_all(self) -> None:
        self.transport.unregister_all(self._registered)

    def _register_with_bootstrap(self) -> None:
        info = {"rank": self.rank, "zmq_endpoint": self.endpoint, "session_id": self.transport.session_id,
                "layout": self.layout.to_dict()}
        deadline = time.monotonic() + 10
        while True:
            try:
                self._bootstrap.register(info)
                return
            except BootstrapUnavailable:
                if time.monotonic() > deadline:
                    self.close()
                    raise
                time.sleep(0.2)

    def _room(self, room: int) -> _Room:
        r = self._rooms.get(room)
        if r is None:
            raise KeyError(f"room {room} is not known to this sender (expect_room first)")
        return r

    def _queue(self, r: _Room, job: tuple) -> None:
        if r.dest is None:
            r.pending.append(job)
        else:
            self._jobs.put(job)

    def _end(self, r: _Room, state: RoomState, reason: str, cause: FailureCause | None,
             event: RoomEventKind | None = RoomEventKind.FAILED, notify: str | None = None) -> bool:
        """Terminal transition (lock held): count it, report it, and have the writer tell decode if needed."""
        if not r.finish(state, reason, cause):
            return False
        self.stats.finished(state, cause)
        r.pending.clear()
        if event is not None:
            self._events.append(RoomEvent(r.room, event, reason))
        if notify is not None:
            if r.receiver is not None:
                self._jobs.put(("notify", r.room, r.receiver.endpoint, notify))
            else:
                r.notify = notify  # sent when decode's destination arrives
        if state != RoomState.SUCCESS:
            logger.info("room %d %s: %s", r.room, state.name, reason)
        return True

    def _accept_destination(self, r: _Room, dest: RoomRequest) -> None:
        receiver = self._receivers.get(dest.receiver_id)
        problem = self._check_destination(dest, receiver)
        if problem is not None:
            if receiver is not None:
                self._channel.send(receiver.endpoint, Status(dest.room, False, problem))
            self._end(r, RoomState.FAILED, problem, FailureCause.HANDSHAKE)
            return
        r.dest, r.receiver, r.digest = dest, receiver, destination_digest(dest)
        if r.state.terminal:  # failed locally before decode's destination came: tell decode now
            if r.notify is not None:
                self._jobs.put(("notify", r.room, receiver.endpoint, r.notify))
                r.notify = None
            return
        r.advance(RoomState.WAITING)
        self._events.append(RoomEvent(r.room, RoomEventKind.READY))
        for job in r.pending:
            self._jobs.put(job)
        r.pending.clear()

    def _check_destination(self, dest: RoomRequest, receiver: _Receiver | None) -> str | None:
        if receiver is None:
            return f"room {dest.room}: decode receiver {dest.receiver_id} has not registered with this prefill"
        if dest.num_tokens < 0 or not 0 <= dest.aux_index < receiver.aux.num_rows:
            return (f"room {dest.room}: invalid destination (num_tokens {dest.num_tokens}, aux index "
                    f"{dest.aux_index} of {receiver.aux.num_rows})")
        for name, region in receiver.regions.items():
            try:
                rows = dest.rows_for(name)
            except KeyError as exc:
                return str(exc.args[0])
            if len(rows) != dest.num_tokens:
                return f"room {dest.room}: {len(rows)} destination rows for region {name!r}, {dest.num_tokens} tokens"
            if len(rows) and (rows.min() < 0 or rows.max() >= region.num_rows):
                return (f"room {dest.room}: destination rows of region {name!r} outside 0..{region.num_rows - 1} "
                        f"(min {rows.min()}, max {rows.max()})")
        return None

    # ---- listener thread ----------------------------------------------------------------------------------------

    def _listen(self) -> None:
        while not self._stop.is_set():
            for item in self._channel.receive(50):
                try:
                    if isinstance(item, Exception):
                        self._on_bad_message(item)
                    else:
                        self._on_message(*item)
                except Exception:  # one bad message must not kill the listener
                    logger.exception("error handling a control message")

    def _on_bad_message(self, exc: Exception) -> None:
        logger.error("refused control message: %s", exc)
        reply_to, msg_type = getattr(exc, "reply_to", ""), getattr(exc, "msg_type", "")
        if reply_to and msg_type == "register":
            self._channel.send(reply_to, RegisterReply("", False, str(exc), self.transport.session_id))

    def _owner(self, room: int) -> str | None:
        """The endpoint of the receiver whose destination a room has (or is waiting with), if any (lock held)."""
        r = self._rooms.get(room)
        if r is not None and r.receiver is not None:
            return r.receiver.endpoint
        early = self._early.get(room)
        if r is None and early is not None and isinstance(early[0], RoomRequest):
            receiver = self._receivers.get(early[0].receiver_id)
            return receiver.endpoint if receiver is not None else None
        return None

    def _on_message(self, msg, reply_to: str) -> None:
        if isinstance(msg, Register):
            self._on_register(msg, reply_to)
        elif isinstance(msg, RoomRequest):
            with self._lock:
                receiver = self._receivers.get(msg.receiver_id)
                if receiver is not None and receiver.endpoint != reply_to:
                    self._channel.reject("wrong_peer", f"room {msg.room}: a destination for receiver "
                                         f"{msg.receiver_id} from an endpoint it did not register from", reply_to)
                    return
                r = self._rooms.get(msg.room)
                if (r is not None and r.dest is not None) or (r is None and msg.room in self._early):
                    self._channel.reject("duplicate_room", f"room {msg.room} already has a destination (or an "
                                         "abort): the first one stands", reply_to)
                    return
                gone = self._gone.pop(msg.room, None)
                if r is None and gone is not None and receiver is not None:
                    self._channel.send(receiver.endpoint, Status(msg.room, False, f"prefill failed: {gone[0]}"))
                elif r is None:
                    self._early[msg.room] = (msg, time.monotonic())
                else:
                    self._accept_destination(r, msg)
        elif isinstance(msg, Abort):
            with self._lock:
                owner = self._owner(msg.room)
                if owner is not None and owner != reply_to:
                    self._channel.reject("wrong_peer", f"abort of room {msg.room} from an endpoint that is not its "
                                         "decode receiver's", reply_to)
                    return
                r = self._rooms.get(msg.room)
                if r is None:
                    self._early[msg.room] = (msg.reason, time.monotonic())  # an abort replaces a destination
                else:
                    self._end(r, RoomState.ABORTED, f"aborted by decode: {msg.reason}", FailureCause.PEER,
                              event=RoomEventKind.ABORTED)
            # acknowledged from the writer, after every job queued before it: nothing is in flight then
            self._jobs.put(("ack", msg.room, reply_to))
        elif isinstance(msg, AbortAck):
            self.stats.ack_received()
        else:
            logger.warning("unexpected control message %s from %s", type(msg).__name__, reply_to)

    def _on_register(self, msg: Register, reply_to: str) -> None:
        sid = self.transport.session_id
        try:
            peer_layout = TransferLayout.from_dict(msg.layout)
            problem = self.layout.mismatch(peer_layout)
            regions = {n: MemoryRegion.from_description(n, d) for n, d in msg.regions.items()}
            aux = MemoryRegion.from_description("aux", msg.aux)
        except (ValueError, KeyError, TypeError) as exc:
            problem = f"malformed registration: {exc}"
        if problem is None:
            for name, src in self.regions.items():
                dst = regions.get(name)
                if dst is None or dst.row_bytes != src.row_bytes or dst.num_layers != src.num_layers:
                    problem = f"transfer layout mismatch: decode's region {name!r} does not match its layout"
            if problem is None and aux.row_bytes < self.layout.aux_bytes:
                problem = f"decode's aux rows ({aux.row_bytes} B) are smaller than the aux record"
        if problem is not None:
            logger.error("refused decode receiver %s (%s): %s", msg.receiver_id, reply_to, problem)
            self._channel.send(reply_to, RegisterReply(msg.receiver_id, False, problem, sid))
            return
        with self._lock:
            self._receivers[msg.receiver_id] = _Receiver(msg.receiver_id, reply_to, regions, aux)
            self._dead_receivers.pop(msg.receiver_id, None)
        logger.info("decode receiver %s registered (%s)", msg.receiver_id, reply_to)
        self._channel.send(reply_to, RegisterReply(msg.receiver_id, True, "", sid))

    # ---- writer thread ------------------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        """Run jobs in order. Write jobs of one room that are already queued behind each other (the writer fell
        behind the caller) go out together, in as few engine calls as the batch cap allows; when the writer keeps
        up, each chunk is written as soon as it is queued."""
        backlog: deque = deque()
        while True:
            job = backlog.popleft() if backlog else self._jobs.get()
            if job is None:
                return
            try:
                if job[0] == "write":
                    batch = [job]
                    while True:
                        if not backlog:
                            try:
                                backlog.append(self._jobs.get_nowait())
                            except queue.Empty:
                                break
                        nxt = backlog[0]
                        if nxt is None or nxt[0] != "write" or nxt[1] != job[1]:
                            break
                        batch.append(backlog.popleft())
                    self._write_chunks(job[1], [(rows, start) for _, _, rows, start in batch])
                else:
                    getattr(self, f"_job_{job[0]}")(*job[1:])
            except Exception:
                logger.exception("sender job %s failed", job[0])

    def _live(self, room: int) -> _Room | None:
        with self._lock:
            r = self._rooms.get(room)
            return r if r is not None and not r.state.terminal else None

    def _write_chunks(self, room: int, chunks: list[tuple[np.ndarray, int]]) -> None:
        """Write chunks (src_rows, token_start) of one room: every region and layer, coalesced runs, one
        `batch_write` (split at the engine's batch cap)."""
        with self._lock:
            r = self._live(room)
            if r is None:
                return
            dest, receiver = r.dest, r.receiver
            for src_rows, token_start in chunks:
                end = token_start + len(src_rows)
                if token_start < 0 or end > dest.num_tokens:
                    self._end(r, RoomState.FAILED, f"room {room}: tokens {token_start}..{end - 1} exceed the "
                              f"{dest.num_tokens} rows decode allocated", FailureCause.HANDSHAKE,
                              notify="prefill sent more tokens than decode allocated")
                    return
            r.advance(RoomState.TRANSFERRING)
            if r.first_write is None:
                r.first_write = time.monotonic()
            dead = self._dead_receivers.get(receiver.receiver_id)
        if dead is not None and time.monotonic() - dead[1] < self.dead_receiver_ttl_s:
            self._write_failed(room, f"decode receiver {receiver.receiver_id} failed {time.monotonic() - dead[1]:.1f}s "
                               f"ago: {dead[0]}")
            return
        srcs: list[int] = []
        dsts: list[int] = []
        lens: list[int] = []
        for src_rows, token_start in chunks:
            end = token_start + len(src_rows)
            runs_by_key: dict[str, list[tuple[int, int, int]]] = {}  # regions sharing destination rows share runs
            for name, src in self.regions.items():
                key = name if name in dest.dst_rows else ALL_REGIONS
                if key not in runs_by_key:
                    runs_by_key[key] = coalesce_runs(src_rows, dest.rows_for(name)[token_start:end])
                s, d, n = run_entries(src, receiver.regions[name], runs_by_key[key])
                srcs += s
                dsts += d
                lens += n
        try:
            nbytes = self.transport.batch_write(receiver.receiver_id, srcs, dsts, lens)
        except TransferError as exc:
            with self._lock:
                self._dead_receivers[receiver.receiver_id] = (str(exc), time.monotonic())
            self._write_failed(room, str(exc))
            return
        self.stats.add_bytes(nbytes)
        with self._lock:
            r.bytes += nbytes

    def _write_failed(self, room: int, reason: str) -> None:
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                return
            if self._end(r, RoomState.FAILED, f"KV transfer to decode failed: {reason}", FailureCause.TRANSFER):
                self._channel.send(r.receiver.endpoint, Status(room, False, f"prefill's write failed: {reason}"))

    def _job_finish(self, room: int, aux: bytes) -> None:
        with self._lock:
            r = self._live(room)
            if r is None:
                return
            dest, receiver = r.dest, r.receiver
            if r.tokens_queued != dest.num_tokens:
                self._end(r, RoomState.FAILED, f"room {room}: finished after {r.tokens_queued} of "
                          f"{dest.num_tokens} tokens", FailureCause.LOCAL,
                          notify=f"prefill sent {r.tokens_queued} of {dest.num_tokens} tokens")
                return
        n = len(aux)
        if n:
            self._aux_staging[:n] = np.frombuffer(aux, dtype=np.uint8)
            try:
                self.transport.batch_write(receiver.receiver_id, [self._aux_staging.ctypes.data],
                                           [receiver.aux.address(0, dest.aux_index)], [n])
            except TransferError as exc:
                with self._lock:
                    self._dead_receivers[receiver.receiver_id] = (str(exc), time.monotonic())
                self._write_failed(room, str(exc))
                return
            self.stats.add_bytes(n)
        with self._lock:
            r.bytes += n
            if self._end(r, RoomState.SUCCESS, "", None, event=RoomEventKind.SUCCESS):
                self._channel.send(receiver.endpoint, Status(room, True, dest_digest=r.digest))
                self.stats.add_latency(time.monotonic() - (r.first_write or r.state_since))

    def _job_notify(self, room: int, endpoint: str, reason: str) -> None:
        self._channel.send(endpoint, Abort(room, reason, self.transport.session_id))

    def _job_ack(self, room: int, reply_to: str) -> None:
        self._channel.send(reply_to, AbortAck(room))
