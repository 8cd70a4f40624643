"""The decode role: admit each PD request like any other (request row + KV pages), tell its prefill server
where to write the prompt's KV, and start decoding it once the KV and the first token have arrived.

Request flow (room = the router's `bootstrap_room`):
1. `add_request`: checked like any request, queued with `remote_prefill` (typed errors → HTTP 400/503).
2. The scheduler admits it when memory allows (the KV manager's own admission: HiSparse takes host pages, a
   device buffer and indexer pages; dense takes device pages) and parks it as TRANSFERRING.
3. `receiver.add_room(room, prefill's bootstrap address, destination rows, aux row)`: HiSparse writes the MLA
   rows straight into the request's host-pool rows and the indexer keys into a host staging area with the same
   row numbers; dense writes everything into host staging rows. The aux row is the request's engine row.
4. Room SUCCESS: the aux record is checked (magic, version, the echoed room, the prompt length), the indexer keys
   (dense: all rows) are copied to the device, the first token is committed (its delta, with its logprob, goes
   to the client) and the request joins the decode batch (HiSparse: its buffer is preloaded as after a
   colocated prefill).
5. Room FAILED: the request ends with `KVTransferError` (503, the transfer layer's reason) and frees everything.
With data-parallel attention every rank runs its own decode role (its own transfer engine, receiver and registered
memory) for the requests the api gave it, so prefill writes each request's KV into the one rank that serves it.
With tensor parallelism alone (`--tp-size N`, every rank runs every request in lockstep: decode_server/runtime/
tp_ranks.py) the KV arrives once, on rank 0, into memory all ranks map (decode_server/disagg/memory.py): rank 0
alone holds the transfer engine and receiver; every rank admits the same requests and computes the same
destinations, and how each room ended (`RoomOutcome`, rank 0's reading of the receiver and the aux record) is
broadcast with the api's messages, so every rank installs the rows and commits the first token at the same
point of its loop.
A client abort of a TRANSFERRING request sends ABORT to prefill; its pages stay allocated until the room ends
(prefill acknowledged, or died), since prefill might otherwise still write into pages handed to someone else.
A client abort before decode had memory for the request (no room sent yet) tells prefill too
(`KVReceiver.abort_unsent`), so prefill frees the prompt's KV at once instead of at its bootstrap timeout.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from decode_server.config import DisaggregationConfig
from decode_server.disagg.aux_record import AuxRecord, AuxRecordError
from decode_server.disagg.bootstrap_info import BootstrapInfo
from decode_server.disagg.layout import engine_layout
from decode_server.disagg.memory import DecodeMemory
from decode_server.disagg.role import (
    PDRole,
    RoleOutcome,
    advertised_host,
    make_auth,
    make_transport,
    require_bootstrap,
)
from decode_server.engine.request import RequestStatus
from decode_server.engine.sampling_params import SamplingParams
from decode_server.engine.types import DisaggStats, RequestDelta
from decode_server.errors import InvalidRequestError, KVTransferError

logger = logging.getLogger(__name__)


@dataclass
class _DecodeRoom:
    rid: str
    info: BootstrapInfo
    row: int = -1  # engine row (= aux row) once admitted
    room_added: bool = False  # admitted and its destination computed (rank 0: sent to the receiver)
    aborted: bool = False  # the client is gone; memory held until the room ends


@dataclass(frozen=True)
class RoomOutcome(RoleOutcome):
    """How a request's room ended, as rank 0 read it: what every rank applies alike (`DecodeRole.apply_outcome`).

    `ok`: the KV and the first token arrived and check out (`first_token`, `logprob` from the aux record);
    otherwise `message` is the request's error (ignored for a request already aborted or gone)."""

    rid: str
    ok: bool
    message: str = ""
    first_token: int = -1
    logprob: Any = None


class DecodeRole(PDRole):
    mode = "decode"

    def __init__(self, engine: Any, cfg: DisaggregationConfig, parallel: Any = None) -> None:
        """`parallel`: the ranks of a tensor-parallel decode server (lockstep), or None for one rank (and for each
        rank of DP attention, which receives its own requests' KV)."""
        super().__init__(engine, cfg, parallel)
        self.memory = DecodeMemory(engine.kv, engine.config.max_running_requests, parallel)
        self.layout = engine_layout(engine, self.memory.regions)
        self.receiver: Any = None  # rank 0 (or the only rank) alone talks to prefill
        self._by_rid: dict[str, _DecodeRoom] = {}
        self._by_room: dict[int, _DecodeRoom] = {}
        if self.talks:
            self._start_receiver(cfg)

    def _start_receiver(self, cfg: DisaggregationConfig) -> None:
        from transfer.receiver import KVReceiver, ReceiverTimeouts
        from transfer.regions import MemoryRegion

        views = self.memory.regions
        self.auth = make_auth(cfg)
        self.transport = make_transport(cfg)
        timeouts = ReceiverTimeouts(
            bootstrap_s=cfg.bootstrap_timeout_s, waiting_s=cfg.waiting_timeout_s,
            heartbeat_interval_s=cfg.heartbeat_interval_s, heartbeat_max_misses=cfg.heartbeat_max_failures,
            abort_ack_timeout_s=max(cfg.transfer_timeout_s, 5.0),
        )
        try:
            self.receiver = KVReceiver(
                self.transport, self.layout, {n: MemoryRegion.from_array(n, v.tensor) for n, v in views.items()},
                MemoryRegion.from_array("aux", self.memory.aux.unsqueeze(0)), timeouts,
                zmq_host=advertised_host(cfg), auth=self.auth,
            )
        except BaseException:
            self.transport.close()
            raise
        logger.info("decode role: transfer session %s, layout %s%s", self.transport.session_id, self.layout,
                    " (rank 0 of a tensor-parallel group: the ranks share the received rows)" if self.lockstep
                    else "")  # fmt: skip

    # -- requests --
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams,
                    bootstrap: BootstrapInfo | None) -> None:
        info = require_bootstrap(bootstrap, self.mode)
        if info.room in self._by_room:
            raise InvalidRequestError(f"bootstrap_room {info.room} is already in flight here", param="bootstrap_room")
        self.engine.add_request(rid, prompt_ids, params, remote_prefill=True)
        entry = _DecodeRoom(rid, info)
        self._by_rid[rid] = entry
        self._by_room[info.room] = entry

    def abort(self, rid: str) -> None:
        entry = self._by_rid.get(rid)
        req = self.engine.get_request(rid)
        if entry is None or req is None or req.status is not RequestStatus.TRANSFERRING or not entry.room_added:
            self.engine.abort_request(rid)
            if entry is not None:
                if not entry.room_added and self.receiver is not None:
                    # prefill may hold the prompt's KV waiting for us: let it go now
                    self.receiver.abort_unsent(entry.info.room, entry.info.host, entry.info.port,
                                               "the request was aborted on the decode server before admission")
                self._forget(entry)
            return
        entry.aborted = True
        self.engine.abort_request(rid, hold_kv=True)
        if self.receiver is not None:  # a room that has ended already ignores it; its outcome frees the memory
            self.receiver.abort(entry.info.room, "the request was aborted on the decode server")

    # -- loop --
    def step(self) -> list[RequestDelta]:
        # A data-parallel attention rank steps every iteration (its step agrees on the pass with the other ranks).
        busy = self.engine.has_unfinished_requests() or getattr(self.engine, "dp_sync", None) is not None
        deltas = self.engine.step() if busy else []
        for req in self.engine.pop_remote_admitted():
            self._send_destination(req)
        if self.receiver is not None:
            for result in self.receiver.poll():
                outcome = self._read_result(result)
                delta = self._settle(outcome) if outcome is not None else None
                if delta is not None:
                    deltas.append(delta)
        return deltas

    def has_pending(self) -> bool:
        return bool(self._by_rid) or bool(self._outcomes)

    def _send_destination(self, req: Any) -> None:
        entry = self._by_rid[req.rid]
        entry.row = req.row
        rows = self.memory.destination(req.row, req.prompt_len)
        entry.room_added = True
        if self.receiver is None:  # another rank of a tensor-parallel group: rank 0 sends it
            return
        try:
            self.receiver.add_room(entry.info.room, entry.info.host, entry.info.port, rows, aux_index=req.row)
        except ValueError as exc:  # the request fails (a failure yields no delta of its own)
            self._settle(RoomOutcome(req.rid, ok=False, message=f"cannot receive the KV: {exc}"))

    def _read_result(self, result: Any) -> RoomOutcome | None:
        """Rank 0: a room's end as the receiver reported it, checked against the aux record prefill wrote."""
        entry = self._by_room.get(result.room)
        if entry is None:
            return None
        req = self.engine.get_request(entry.rid)
        if entry.aborted or req is None:
            return RoomOutcome(entry.rid, ok=False)
        if not result.ok:
            return RoomOutcome(entry.rid, ok=False, message=f"KV transfer from prefill failed: {result.reason}")
        try:
            record = AuxRecord.decode(self.memory.read_aux(entry.row), entry.info.room)
            if record.prompt_len != req.prompt_len:
                raise AuxRecordError(f"prefill computed {record.prompt_len} prompt tokens, this request has "
                                     f"{req.prompt_len} (the two servers got different prompts)")
        except AuxRecordError as exc:
            return RoomOutcome(entry.rid, ok=False, message=f"KV transfer from prefill failed: {exc}")
        return RoomOutcome(entry.rid, ok=True, first_token=record.first_token, logprob=self._logprob(req, record))

    def apply_outcome(self, outcome: RoleOutcome) -> RequestDelta | None:
        """Every rank: end the room's request as rank 0 read it — install the rows and commit the first token, or
        fail it; either way (and for a request aborted meanwhile) every staging row and page it held is freed."""
        assert isinstance(outcome, RoomOutcome)
        entry = self._by_rid.get(outcome.rid)
        if entry is None:
            return None
        self._forget(entry)
        row = entry.row
        if entry.aborted:  # the client left earlier; prefill can no longer write: free everything now
            self.memory.release(row)
            self.engine.release_held(entry.rid)
            return None
        req = self.engine.get_request(entry.rid)
        if req is None:
            self.memory.release(row)
            return None
        if not outcome.ok:
            self.memory.release(row)
            self.engine.fail_request(entry.rid, KVTransferError.__name__, outcome.message)
            return None
        self.memory.install(row, req.prompt_len)
        return self.engine.commit_remote_prefill(entry.rid, outcome.first_token, outcome.logprob)

    def _control_endpoint(self) -> str:
        return self.receiver.endpoint if self.receiver is not None else ""

    @staticmethod
    def _logprob(req: Any, record: AuxRecord) -> Any:
        if req.params.logprobs is None:
            return None
        lp = record.token_logprob()
        if lp is not None:
            lp.top_logprobs = lp.top_logprobs[: req.params.logprobs]
        return lp

    def _forget(self, entry: _DecodeRoom) -> None:
        self._by_rid.pop(entry.rid, None)
        self._by_room.pop(entry.info.room, None)

    # -- stats, shutdown --
    def _disagg_stats(self) -> DisaggStats:
        stats = self._transfer_stats(self.receiver)
        sched = self.engine.scheduler
        stats.num_transferring_reqs = len(sched.transferring)
        stats.num_prealloc_reqs = sum(1 for r in sched.waiting if r.remote_prefill)
        stats.staging_rows = self.memory.staging_usage()
        stats.aux_rows_used = sum(1 for e in self._by_rid.values() if e.room_added)
        return stats

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.transport.close()
