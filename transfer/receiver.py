"""KV receiver (decode side): tells prefill where to write each room's rows, and reports when they arrived.

Its destination regions (the host KV pool, the indexer staging area) and aux region are registered with the
transfer engine ONCE, here, whole; rooms only name rows in them. Threads: a listener (prefill's control
messages), one connector per prefill peer (bootstrap lookup, handshake, register) and a heartbeat (GET /health on
every prefill peer with rooms in flight). Timeouts are applied in `poll()` (the engine loop calls it every step).

Page safety: a room reports its end only when prefill cannot write into its pages any more: on SUCCESS/FAILED
status from prefill, on prefill's ABORT, on prefill's ABORT_ACK after our ABORT, or when prefill is declared dead
(heartbeat misses). Our own aborts and waiting timeouts first wait for the ACK (state ABORTING), at most
`abort_ack_timeout_s`.

Who may end a room: STATUS, ABORT and ABORT_ACK of a room are taken only from the endpoint of the prefill the room
was sent to, and a SUCCESS only if its destination digest equals that of the destination we registered for the
room (rows, aux row, token count, our session): a completion claimed for any other regions fails the room. With a
cluster secret (`auth`) every control message and bootstrap answer is authenticated too; a prefill that refuses
our authentication (or answers without it) fails its rooms at once, cause `auth`, instead of being retried.
Refusals are logged once and counted in `stats.rejected`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from transfer.auth import PDAuth
from transfer.bootstrap import BootstrapAuthError, BootstrapClient, BootstrapUnavailable
from transfer.channel import ControlChannel
from transfer.layout import TransferLayout
from transfer.messages import (
    Abort,
    AbortAck,
    ProtocolError,
    Register,
    RegisterReply,
    RoomRequest,
    Status,
    destination_digest,
)
from transfer.mooncake_transport import MooncakeTransport
from transfer.regions import MemoryRegion
from transfer.rooms import FailureCause, RoomBase, RoomState, TransferStats, count_by_state

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReceiverTimeouts:
    bootstrap_s: float = 300.0  # prefill's bootstrap server must answer and accept us within this
    waiting_s: float = 300.0  # after the destination is sent, the data must arrive within this
    heartbeat_interval_s: float = 5.0
    heartbeat_max_misses: int = 2  # consecutive failed heartbeats that declare a prefill peer dead
    abort_ack_timeout_s: float = 30.0  # after our ABORT, wait at most this for prefill's ACK


@dataclass(frozen=True)
class RoomResult:
    room: int
    ok: bool
    reason: str = ""


class _PeerState(Enum):
    CONNECTING = 1
    READY = 2
    GONE = 3  # refused, dead or closed: a new room starts a new connection


@dataclass
class _Peer:
    host: str
    port: int
    state: _PeerState = _PeerState.CONNECTING
    endpoint: str = ""  # prefill's ZMQ endpoint
    session_id: str = ""
    last_error: str = ""
    misses: int = 0
    reply: RegisterReply | None = None
    replied: threading.Event = field(default_factory=threading.Event)
    rooms: set[int] = field(default_factory=set)
    unsent_aborts: list[int] = field(default_factory=list)  # aborted before prefill heard of them
    aborts_since: float | None = None  # when the oldest unsent abort was queued (given up after the bootstrap timeout)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class _Room(RoomBase):
    peer: _Peer | None = None
    request: RoomRequest | None = None
    digest: bytes = b""  # destination_digest(request): what prefill's SUCCESS must name
    sent_at: float | None = None
    nbytes: int = 0
    abort_reason: str = ""
    abort_state: RoomState = RoomState.ABORTED
    abort_cause: FailureCause | None = None
    reported: bool = False


class KVReceiver:
    def __init__(
        self,
        transport: MooncakeTransport,
        layout: TransferLayout,
        dst_regions: Sequence[MemoryRegion] | Mapping[str, MemoryRegion],
        aux_region: MemoryRegion,
        timeouts: ReceiverTimeouts | None = None,
        zmq_host: str = "127.0.0.1",
        bootstrap_rank: int = 0,
        auth: PDAuth | None = None,
    ) -> None:
        regions = dict(dst_regions) if isinstance(dst_regions, Mapping) else {r.name: r for r in dst_regions}
        got = {n: r.row_bytes for n, r in regions.items()}
        if got != layout.regions:
            raise ValueError(f"destination regions {got} do not match the layout's regions {layout.regions}")
        for r in regions.values():
            if r.num_layers != layout.num_layers:
                raise ValueError(f"region {r.name!r} has {r.num_layers} layers, the layout {layout.num_layers}")
        if aux_region.num_layers != 1 or aux_region.row_bytes < layout.aux_bytes:
            raise ValueError(f"aux region needs one layer of rows >= {layout.aux_bytes} B")
        self.transport, self.layout, self.regions, self.aux = transport, layout, regions, aux_region
        self.timeouts = timeouts or ReceiverTimeouts()
        self.auth = auth
        self.bootstrap_rank = bootstrap_rank
        self.stats = TransferStats()
        self._bytes_per_token = sum(r.row_bytes for r in regions.values()) * layout.num_layers
        self._lock = threading.RLock()
        self._rooms: dict[int, _Room] = {}
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._stop = threading.Event()
        self._registered: list[int] = []
        try:
            for r in [*regions.values(), aux_region]:
                transport.register(r.base_ptr, r.nbytes)
                self._registered.append(r.base_ptr)
            self._channel = ControlChannel(zmq_host, auth, on_reject=self.stats.reject)
        except Exception:
            self._unregister_all()
            raise
        self._listener = threading.Thread(target=self._listen, name="kv-receiver-listen", daemon=True)
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="kv-receiver-heartbeat", daemon=True)
        self._listener.start()
        self._heartbeat.start()

    # ---- public API ---------------------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return self._channel.endpoint

    def add_room(
        self,
        room: int,
        bootstrap_host: str,
        bootstrap_port: int,
        dst_rows: Sequence[int] | Mapping[str, Sequence[int]],
        aux_index: int,
    ) -> None:
        """Ask the prefill behind (bootstrap_host, bootstrap_port) to write `room` into `dst_rows` (one row per
        prompt token; the same rows for every region, or a mapping region -> rows) and the aux record into aux row
        `aux_index`. Non-blocking: the result comes from `poll()`."""
        if isinstance(dst_rows, Mapping):
            lengths = {len(v) for v in dst_rows.values()}
            if set(dst_rows) != set(self.regions) or len(lengths) != 1:
                raise ValueError(f"dst_rows must give the same number of rows for exactly {sorted(self.regions)}")
            num_tokens = lengths.pop()
            per_region = dst_rows
        else:
            num_tokens = len(dst_rows)
            per_region = {n: dst_rows for n in self.regions}
        for name, rows in per_region.items():
            arr = np.asarray(rows, dtype=np.int64)
            bad = arr[(arr < 0) | (arr >= self.regions[name].num_rows)]
            if bad.size:
                raise ValueError(f"room {room}: rows {bad[:4].tolist()} outside region {name!r} "
                                 f"(0..{self.regions[name].num_rows - 1})")
        if not 0 <= aux_index < self.aux.num_rows:
            raise ValueError(f"aux index {aux_index} outside the aux region (0..{self.aux.num_rows - 1})")
        request = RoomRequest(room, self.transport.session_id, num_tokens, aux_index, RoomRequest.pack_rows(dst_rows))
        with self._lock:
            if room in self._rooms:
                raise ValueError(f"room {room} is already in flight on this receiver")
            r = _Room(room, request=request, digest=destination_digest(request),
                      nbytes=num_tokens * self._bytes_per_token + self.layout.aux_bytes)
            self._rooms[room] = r
            self.stats.started()
            peer = self._peer(bootstrap_host, bootstrap_port)
            r.peer = peer
            peer.rooms.add(room)
            if peer.state == _PeerState.READY:
                self._send_room(r)

    def abort_unsent(self, room: int, bootstrap_host: str, bootstrap_port: int,
                     reason: str = "aborted by decode") -> None:
        """Tell the prefill behind (bootstrap_host, bootstrap_port) that `room` will never be added here (its
        request ended on decode before decode had memory for it), so prefill frees the room's KV now instead of
        at its bootstrap timeout. Best effort: delivered once connected, given up after the bootstrap timeout."""
        with self._lock:
            if room in self._rooms:
                raise ValueError(f"room {room} is in flight on this receiver: use abort()")
            peer = self._peer(bootstrap_host, bootstrap_port)
            if peer.state == _PeerState.READY:
                self._channel.send(peer.endpoint, Abort(room, reason, self.transport.session_id))
            else:
                peer.unsent_aborts.append(room)
                peer.aborts_since = peer.aborts_since or time.monotonic()

    def abort(self, room: int, reason: str = "aborted by decode") -> None:
        """Give the room up. It reports (ok=False) once prefill can no longer write into its pages."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None or r.state.terminal or r.state == RoomState.ABORTING:
                return
            self._abort(r, reason, RoomState.ABORTED, FailureCause.LOCAL)

    def poll(self) -> list[RoomResult]:
        """Rooms that ended since the last poll (each exactly once; it is then forgotten). Applies timeouts."""
        now = time.monotonic()
        t = self.timeouts
        out: list[RoomResult] = []
        with self._lock:
            for r in list(self._rooms.values()):
                age = now - r.state_since
                if r.state == RoomState.BOOTSTRAPPING and age > t.bootstrap_s:
                    last = r.peer.last_error if r.peer else ""
                    self._end(r, RoomState.FAILED, f"bootstrap timeout: prefill bootstrap server "
                              f"{r.peer.address if r.peer else '?'} did not accept room {r.room} within "
                              f"{t.bootstrap_s:g}s" + (f" ({last})" if last else ""), FailureCause.BOOTSTRAP_TIMEOUT)
                elif r.state == RoomState.WAITING and age > t.waiting_s:
                    self._abort(r, f"waiting timeout: room {r.room}'s KV did not arrive within {t.waiting_s:g}s",
                                RoomState.FAILED, FailureCause.WAITING_TIMEOUT)
                elif r.state == RoomState.ABORTING and age > t.abort_ack_timeout_s:
                    self._end(r, r.abort_state, f"{r.abort_reason} (prefill did not acknowledge the abort within "
                              f"{t.abort_ack_timeout_s:g}s)", r.abort_cause)
                if r.state.terminal:
                    out.append(RoomResult(r.room, r.state == RoomState.SUCCESS, r.reason))
                    self._forget(r)
        return out

    def num_rooms_by_state(self) -> dict[str, int]:
        with self._lock:
            return count_by_state(self._rooms.values())

    def close(self) -> None:
        """Abort rooms in flight (best effort), stop the threads, unregister our regions."""
        with self._lock:
            for r in self._rooms.values():
                if r.peer is not None and r.peer.state == _PeerState.READY and r.sent_at is not None:
                    self._channel.send(r.peer.endpoint, Abort(r.room, "decode receiver closed",
                                                              self.transport.session_id))
                self._end(r, RoomState.FAILED, "decode receiver closed", FailureCause.CLOSED)
            for peer in self._peers.values():
                peer.state = _PeerState.GONE
                peer.replied.set()
        self._stop.set()
        self._listener.join(5)
        self._heartbeat.join(5)
        self._channel.close()
        self._unregister_all()

    # ---- room transitions (lock held) ---------------------------------------------------------------------------

    def _end(self, r: _Room, state: RoomState, reason: str, cause: FailureCause | None) -> None:
        if not r.finish(state, reason, cause):
            return
        self.stats.finished(state, cause)
        if state == RoomState.SUCCESS:
            self.stats.add_bytes(r.nbytes)
            self.stats.add_latency(time.monotonic() - (r.sent_at or r.created))
        else:
            logger.info("room %d %s: %s", r.room, state.name, reason)

    def _abort(self, r: _Room, reason: str, final: RoomState, cause: FailureCause | None) -> None:
        if r.sent_at is None:  # prefill never heard of the room: nothing can be in flight
            self._end(r, final, reason, cause)
            if r.peer is not None:  # prefill may be waiting for it: tell it once connected, so it frees early
                r.peer.unsent_aborts.append(r.room)
                r.peer.aborts_since = r.peer.aborts_since or time.monotonic()
            return
        r.abort_reason, r.abort_state, r.abort_cause = reason, final, cause
        r.advance(RoomState.ABORTING)
        self._channel.send(r.peer.endpoint, Abort(r.room, reason, self.transport.session_id))

    def _peer(self, host: str, port: int) -> _Peer:
        """The peer record of a prefill bootstrap address; a new one (and its connector thread) if none is alive."""
        peer = self._peers.get((host, port))
        if peer is None or peer.state == _PeerState.GONE:
            peer = _Peer(host, port)
            self._peers[(host, port)] = peer
            threading.Thread(target=self._connect, args=(peer,), name=f"kv-connect-{peer.address}",
                             daemon=True).start()
        return peer

    def _forget(self, r: _Room) -> None:
        del self._rooms[r.room]
        if r.peer is not None:
            r.peer.rooms.discard(r.room)

    def _send_room(self, r: _Room) -> None:
        if r.state != RoomState.BOOTSTRAPPING:
            return
        self._channel.send(r.peer.endpoint, r.request)
        r.sent_at = time.monotonic()
        r.advance(RoomState.WAITING)

    def _fail_peer_rooms(self, peer: _Peer, reason: str, cause: FailureCause) -> None:
        for room in list(peer.rooms):
            r = self._rooms.get(room)
            if r is not None and r.state == RoomState.ABORTING:
                self._end(r, r.abort_state, f"{r.abort_reason} ({reason})", r.abort_cause)
            elif r is not None:
                self._end(r, RoomState.FAILED, reason, cause)

    # ---- connector threads --------------------------------------------------------------------------------------

    def _connect(self, peer: _Peer) -> None:
        """Look up prefill's rank, check its layout, register, then send the rooms waiting for it. Retries
        while rooms wait (their bootstrap timeout is applied by poll)."""
        client = BootstrapClient(peer.host, peer.port, timeout_s=min(2.0, self.timeouts.bootstrap_s), auth=self.auth)
        auth_problem = None
        while not self._stop.is_set():
            with self._lock:
                live_rooms = any(self._rooms.get(x) is not None and not self._rooms[x].state.terminal
                                 for x in peer.rooms)
                aborts_wait = bool(peer.unsent_aborts) and (
                    time.monotonic() - (peer.aborts_since or 0.0) < self.timeouts.bootstrap_s)
                if peer.state == _PeerState.GONE or not (live_rooms or aborts_wait):
                    peer.state = _PeerState.GONE
                    return
            try:
                info = client.lookup(self.bootstrap_rank)
                break
            except BootstrapAuthError as exc:  # another secret, or none on one side: retrying cannot help
                auth_problem = peer.last_error = str(exc)
                break
            except BootstrapUnavailable as exc:
                peer.last_error = str(exc)
                self._stop.wait(min(0.5, self.timeouts.bootstrap_s / 10))
        else:
            return
        if auth_problem is not None:
            with self._lock:
                if peer.state != _PeerState.GONE:
                    logger.error("authentication with prefill %s failed: %s", peer.address, auth_problem)
                    peer.state = _PeerState.GONE
                    self._fail_peer_rooms(peer, f"authentication with prefill failed: {auth_problem}",
                                          FailureCause.AUTH)
            return
        try:
            theirs = TransferLayout.from_dict(info["layout"])
            problem = self.layout.mismatch(theirs)
            peer.endpoint, peer.session_id = str(info["zmq_endpoint"]), str(info["session_id"])
        except (KeyError, TypeError, ValueError) as exc:
            problem = f"malformed bootstrap answer from {peer.address}: {exc}"
        if problem is None:
            self._channel.send(peer.endpoint, Register(self.transport.session_id, self.layout.to_dict(),
                                                       {n: r.describe() for n, r in self.regions.items()},
                                                       self.aux.describe()))
            if not peer.replied.wait(self.timeouts.bootstrap_s):
                problem = f"prefill {peer.address} did not answer our registration within {self.timeouts.bootstrap_s:g}s"
            elif peer.reply is not None and not peer.reply.ok:
                problem = f"prefill {peer.address} refused our registration: {peer.reply.reason}"
        with self._lock:
            if peer.state == _PeerState.GONE:
                return
            if problem is not None:
                logger.error("handshake with prefill %s failed: %s", peer.address, problem)
                peer.state = _PeerState.GONE
                self._fail_peer_rooms(peer, problem, FailureCause.HANDSHAKE)
                return
            peer.state = _PeerState.READY
            logger.info("registered with prefill %s (%s)", peer.address, peer.endpoint)
            for room in list(peer.rooms):
                r = self._rooms.get(room)
                if r is not None:
                    self._send_room(r)
            for room in peer.unsent_aborts:
                self._channel.send(peer.endpoint, Abort(room, "aborted by decode", self.transport.session_id))
            peer.unsent_aborts.clear()
            peer.aborts_since = None

    # ---- heartbeat thread ---------------------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        """Every interval, ask each connected prefill's bootstrap server for its route (a health check that also
        sees a restart: a new session id). Dead after `heartbeat_max_misses` failures in a row; restarted at once.
        Either way its rooms in flight fail and the next room connects afresh."""
        interval = self.timeouts.heartbeat_interval_s
        while not self._stop.wait(interval):
            with self._lock:
                peers = [p for p in self._peers.values() if p.state == _PeerState.READY]
            for peer in peers:
                client = BootstrapClient(peer.host, peer.port, timeout_s=max(0.05, min(interval, 2.0)), auth=self.auth)
                reason = None
                try:
                    info = client.lookup(self.bootstrap_rank)
                    peer.misses = 0
                    if info.get("session_id") != peer.session_id:
                        reason = (f"prefill {peer.address} restarted (session {peer.session_id} -> "
                                  f"{info.get('session_id')})")
                except BootstrapAuthError as exc:
                    reason = f"prefill {peer.address} no longer authenticates with our secret: {exc}"
                except BootstrapUnavailable as exc:
                    peer.misses += 1
                    peer.last_error = str(exc)
                    if peer.misses >= self.timeouts.heartbeat_max_misses:
                        reason = (f"lost connection with prefill {peer.address}: {peer.misses} heartbeats missed "
                                  f"({peer.last_error})")
                if reason is None:
                    continue
                with self._lock:
                    if peer.state != _PeerState.READY:
                        continue
                    peer.state = _PeerState.GONE
                    # if only its bootstrap server died, prefill itself may live: tell it to stop (best effort)
                    for room in peer.rooms:
                        self._channel.send(peer.endpoint, Abort(room, reason, self.transport.session_id))
                    self._fail_peer_rooms(peer, reason, FailureCause.HEARTBEAT)
                self._channel.forget(peer.endpoint)

    # ---- listener thread ----------------------------------------------------------------------------------------

    def _listen(self) -> None:
        while not self._stop.is_set():
            for item in self._channel.receive(50):
                try:
                    if isinstance(item, ProtocolError):
                        self._on_bad_message(item)
                    else:
                        self._on_message(*item)
                except Exception:
                    logger.exception("error handling a control message")

    def _peer_by_endpoint(self, endpoint: str) -> _Peer | None:
        for peer in self._peers.values():
            if peer.endpoint == endpoint and peer.state != _PeerState.GONE:
                return peer
        return None

    def _on_bad_message(self, exc: ProtocolError) -> None:
        logger.error("refused control message: %s", exc)
        with self._lock:
            peer = self._peer_by_endpoint(getattr(exc, "reply_to", ""))
            if peer is not None:
                peer.state = _PeerState.GONE
                peer.reply = RegisterReply("", False, str(exc))
                peer.replied.set()
                self._fail_peer_rooms(peer, str(exc), FailureCause.HANDSHAKE)

    def _on_message(self, msg, reply_to: str) -> None:
        with self._lock:
            if isinstance(msg, RegisterReply):
                peer = self._peer_by_endpoint(reply_to)
                if peer is not None:
                    peer.reply = msg
                    peer.replied.set()
                return
            r = self._rooms.get(getattr(msg, "room", -1))
            if r is not None and (r.peer is None or r.peer.endpoint != reply_to):
                self._channel.reject("wrong_peer", f"{type(msg).__name__} for room {r.room} from an endpoint that "
                                     "is not the room's prefill", reply_to)
                return
            if isinstance(msg, Status):
                if r is None or r.state.terminal:
                    return
                if r.state == RoomState.ABORTING:  # prefill is done with the room either way
                    self._end(r, r.abort_state, r.abort_reason, r.abort_cause)
                elif msg.ok and msg.dest_digest != r.digest:
                    self._channel.reject("wrong_destination", f"room {r.room}: prefill reported a completion for "
                                         "other regions than the ones we registered for the room", reply_to)
                    self._end(r, RoomState.FAILED, "prefill reported completing a destination other than the one "
                              "this decode server registered for the room", FailureCause.HANDSHAKE)
                elif msg.ok:
                    self._end(r, RoomState.SUCCESS, "", None)
                else:
                    self._end(r, RoomState.FAILED, f"prefill failed the room: {msg.reason}", FailureCause.PEER)
            elif isinstance(msg, Abort):
                if r is not None:
                    if r.state == RoomState.ABORTING:
                        self._end(r, r.abort_state, r.abort_reason, r.abort_cause)
                    else:
                        self._end(r, RoomState.FAILED, f"prefill aborted the room: {msg.reason}", FailureCause.PEER)
                self._channel.send(reply_to, AbortAck(msg.room))
            elif isinstance(msg, AbortAck):
                self.stats.ack_received()
                if r is not None and r.state == RoomState.ABORTING:
                    self._end(r, r.abort_state, r.abort_reason, r.abort_cause)

    def _unregister_all(self) -> None:
        self.transport.unregister_all(self._registered)
