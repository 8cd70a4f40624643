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
from decode_server.disagg.role import PDRole, advertised_host, make_auth, make_transport, require_bootstrap
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
    room_added: bool = False
    aborted: bool = False  # the client is gone; memory held until the room ends


class DecodeRole(PDRole):
    mode = "decode"

    def __init__(self, engine: Any, cfg: DisaggregationConfig) -> None:
        super().__init__(engine, cfg)
        from transfer.receiver import KVReceiver, ReceiverTimeouts
        from transfer.regions import MemoryRegion

        self.memory = DecodeMemory(engine.kv, engine.config.max_running_requests)
        views = self.memory.regions
        self.layout = engine_layout(engine, views)
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
        self._by_rid: dict[str, _DecodeRoom] = {}
        self._by_room: dict[int, _DecodeRoom] = {}
        logger.info("decode role: transfer session %s, layout %s", self.transport.session_id, self.layout)

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
                if not entry.room_added:  # prefill may hold the prompt's KV waiting for us: let it go now
                    self.receiver.abort_unsent(entry.info.room, entry.info.host, entry.info.port,
                                               "the request was aborted on the decode server before admission")
                self._forget(entry)
            return
        entry.aborted = True
        self.engine.abort_request(rid, hold_kv=True)
        self.receiver.abort(entry.info.room, "the request was aborted on the decode server")

    # -- loop --
    def step(self) -> list[RequestDelta]:
        # A data-parallel attention rank steps every iteration (its step agrees on the pass with the other ranks).
        busy = self.engine.has_unfinished_requests() or getattr(self.engine, "dp_sync", None) is not None
        deltas = self.engine.step() if busy else []
        for req in self.engine.pop_remote_admitted():
            self._send_destination(req)
        for result in self.receiver.poll():
            delta = self._on_result(result)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def has_pending(self) -> bool:
        return bool(self._by_rid)

    def _send_destination(self, req: Any) -> None:
        entry = self._by_rid[req.rid]
        entry.row = req.row
        rows = self.memory.destination(req.row, req.prompt_len)
        try:
            self.receiver.add_room(entry.info.room, entry.info.host, entry.info.port, rows, aux_index=req.row)
        except ValueError as exc:
            self.memory.release(req.row)
            self.engine.fail_request(req.rid, KVTransferError.__name__, f"cannot receive the KV: {exc}")
            self._forget(entry)
            return
        entry.room_added = True

    def _on_result(self, result: Any) -> RequestDelta | None:
        entry = self._by_room.get(result.room)
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
        if not result.ok:
            self.memory.release(row)
            self.engine.fail_request(entry.rid, KVTransferError.__name__, f"KV transfer from prefill failed: {result.reason}")
            return None
        try:
            record = AuxRecord.decode(self.memory.read_aux(row), entry.info.room)
            if record.prompt_len != req.prompt_len:
                raise AuxRecordError(f"prefill computed {record.prompt_len} prompt tokens, this request has "
                                     f"{req.prompt_len} (the two servers got different prompts)")
        except AuxRecordError as exc:
            self.memory.release(row)
            self.engine.fail_request(entry.rid, KVTransferError.__name__, f"KV transfer from prefill failed: {exc}")
            return None
        self.memory.install(row, req.prompt_len)
        return self.engine.commit_remote_prefill(entry.rid, record.first_token, self._logprob(req, record))

    def _control_endpoint(self) -> str:
        return self.receiver.endpoint

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
        self.receiver.close()
        self.transport.close()
