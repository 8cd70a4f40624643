"""The prefill role: run each PD request's prompt once decode has said where its KV goes, stream every chunk's
rows to decode as soon as the chunk is computed, then the aux record (first token, its logprobs, the room).

Request flow (room = the router's `bootstrap_room`):
1. `add_request`: checked like any request (typed errors → HTTP 400), then parked as BOOTSTRAPPING:
   `sender.expect_room(room)`; the engine has not seen it yet, so it holds no memory.
2. Sender event READY (decode's destination arrived): the request enters the engine with `max_tokens=1` and
   `hold_kv` (its KV must outlive the request until the transfer ends).
3. After each prefill pass, the engine's chunk hook (the device already synced) hands the chunk's cache slots to
   `sender.send_rows`; the writes run on the sender's thread while the next chunk computes.
4. The first token is sampled: the HTTP response gets it (finish_reason "length": prefill never decodes), and
   `sender.finish(room, aux)` queues the aux record and the SUCCESS status behind the last rows.
5. Sender event SUCCESS / FAILED / ABORTED: the held KV is freed and the room released. A failure before the
   first token ends the HTTP request with `KVTransferError` (503): bootstrap timeout (decode never sent the
   destination), handshake refused, decode aborted the room or died (a write failed).
A client abort on prefill fails the room (decode hears ABORT and frees its pages) and frees the KV.

A tensor-parallel prefill server (`--tp-size N`: every rank computes every prompt, and MLA's latent rows and the
indexer keys are the same on every rank) sends from rank 0's cache only: rank 0 alone runs the bootstrap server
and the sender. Each sender event (`PrefillOutcome`) is broadcast by the group's loop and applied by every rank
alike (decode_server/runtime/tp_ranks.py), so all of them admit a request when decode's destination arrives and
free its held KV when its room ends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from decode_server.config import DisaggregationConfig
from decode_server.disagg.aux_record import AuxRecord
from decode_server.disagg.bootstrap_info import BootstrapInfo
from decode_server.disagg.layout import engine_layout
from decode_server.disagg.memory import prefill_regions, prefill_rows
from decode_server.disagg.role import (
    PDRole,
    RoleOutcome,
    advertised_host,
    error_delta,
    make_auth,
    make_transport,
    require_bootstrap,
)
from decode_server.engine.request import Request
from decode_server.engine.sampling_params import SamplingParams
from decode_server.engine.types import DisaggStats, RequestDelta
from decode_server.errors import DecodeServerError, InvalidRequestError, KVTransferError

logger = logging.getLogger(__name__)


@dataclass
class _PrefillRoom:
    rid: str
    room: int
    prompt_ids: list[int]
    params: SamplingParams
    in_engine: bool = False
    finished: bool = False  # the first token went out (the HTTP request is over); KV held until the room ends
    rows_queued: int = 0  # prompt rows handed to the sender so far (a cached prefix goes with the first chunk)


@dataclass(frozen=True)
class PrefillOutcome(RoleOutcome):
    """One sender event of a room as rank 0 polled it: `kind` is a `transfer.sender.RoomEventKind` value (decode's
    destination arrived; the transfer succeeded, failed or was aborted by decode)."""

    room: int
    kind: str
    reason: str = ""


class PrefillRole(PDRole):
    mode = "prefill"

    def __init__(self, engine: Any, cfg: DisaggregationConfig, parallel: Any = None) -> None:
        super().__init__(engine, cfg, parallel)
        self.sender: Any = None  # rank 0 (or the only rank) alone talks to decode
        self.bootstrap_server: Any = None
        self._by_rid: dict[str, _PrefillRoom] = {}
        self._by_room: dict[int, _PrefillRoom] = {}
        self._deltas: list[RequestDelta] = []
        engine.prefill_chunk_hook = self._on_chunks
        if self.talks:
            self._start_sender(cfg)

    def _start_sender(self, cfg: DisaggregationConfig) -> None:
        from transfer.bootstrap import BootstrapServer
        from transfer.regions import MemoryRegion
        from transfer.sender import KVSender

        engine = self.engine
        views = prefill_regions(engine.kv)
        self.layout = engine_layout(engine, views)
        self.auth = make_auth(cfg)
        self.transport = make_transport(cfg)
        try:
            self.bootstrap_server = BootstrapServer(cfg.host, cfg.bootstrap_port, auth=self.auth)
        except BaseException:
            self.transport.close()
            raise
        try:
            self.sender = KVSender(
                self.transport, self.layout, {n: MemoryRegion.from_array(n, v.tensor) for n, v in views.items()},
                bootstrap=(advertised_host(cfg), self.bootstrap_server.port), zmq_host=advertised_host(cfg),
                bootstrap_timeout_s=cfg.bootstrap_timeout_s, auth=self.auth,
            )
        except BaseException:
            self.bootstrap_server.close()
            self.transport.close()
            raise
        logger.info("prefill role: bootstrap server on %s:%d, transfer session %s, layout %s%s", cfg.host,
                    self.bootstrap_server.port, self.transport.session_id, self.layout,
                    " (rank 0 of a tensor-parallel group: it sends its own cache's rows)" if self.lockstep else "")

    # -- requests --
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams,
                    bootstrap: BootstrapInfo | None) -> None:
        info = require_bootstrap(bootstrap, self.mode)
        if info.room in self._by_room:
            raise InvalidRequestError(f"bootstrap_room {info.room} is already in flight here", param="bootstrap_room")
        one = params.model_copy(update={"max_tokens": 1})
        self.engine.validate_request(rid, prompt_ids, one)
        if rid in self._by_rid:
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="rid")
        if self.sender is not None:
            self.sender.expect_room(info.room)
        entry = _PrefillRoom(rid, info.room, list(prompt_ids), one)
        self._by_rid[rid] = entry
        self._by_room[info.room] = entry

    def abort(self, rid: str) -> None:
        entry = self._by_rid.get(rid)
        if entry is None:
            self.engine.abort_request(rid)
            return
        if self.sender is not None:
            self.sender.fail(entry.room, "the request was aborted on the prefill server")
        self._end(entry, None)

    # -- loop --
    def step(self) -> list[RequestDelta]:
        if self.sender is not None:
            for event in self.sender.poll():
                self._settle(PrefillOutcome(event.room, str(event.kind), event.reason))
        deltas = self.engine.step() if self.engine.has_unfinished_requests() else []
        for delta in deltas:
            entry = self._by_rid.get(delta.rid)
            if entry is not None and delta.finished:
                self._on_first_token(entry, delta)
        out, self._deltas = self._deltas + deltas, []
        return out

    def has_pending(self) -> bool:
        return bool(self._by_rid) or bool(self._outcomes)

    def apply_outcome(self, outcome: RoleOutcome) -> RequestDelta | None:
        """Every rank: a sender event of a room — admit the request (decode's destination arrived), or end it and
        free its held KV (the transfer ended). Deltas it causes come out of the next `step()`."""
        from transfer.sender import RoomEventKind

        assert isinstance(outcome, PrefillOutcome)
        entry = self._by_room.get(outcome.room)
        if entry is None:
            if self.sender is not None:
                self.sender.release(outcome.room)
            return None
        if outcome.kind == RoomEventKind.READY:
            try:
                self.engine.add_request(entry.rid, entry.prompt_ids, entry.params, hold_kv=True)
            except DecodeServerError as exc:
                if self.sender is not None:
                    self.sender.fail(entry.room, f"prefill refused the request: {exc.message}")
                self._end(entry, (type(exc).__name__, exc.message))
                return None
            entry.in_engine = True
        elif outcome.kind == RoomEventKind.SUCCESS:
            self._end(entry, None)
        else:
            self._end(entry, (KVTransferError.__name__, f"KV transfer to decode failed: {outcome.reason}"))
        return None

    def _on_chunks(self, chunks: list[tuple[Request, int, int]]) -> None:
        """Engine hook after a prefill pass: queue each PD request's new rows for decode. With prefix caching a
        prompt's first chunk starts after its cached prefix, whose rows decode needs too: they go with it."""
        if self.sender is None:  # another rank of a tensor-parallel group: rank 0 sends the same rows
            return
        for req, start, n in chunks:
            entry = self._by_rid.get(req.rid)
            if entry is not None:
                first = min(entry.rows_queued, start)
                self.sender.send_rows(entry.room, prefill_rows(self.engine.kv, req.row, first, start + n - first),
                                      first)
                entry.rows_queued = start + n

    def _on_first_token(self, entry: _PrefillRoom, delta: RequestDelta) -> None:
        if not delta.new_token_ids:  # ended without a token (failed or aborted): handled where it ended
            return
        entry.finished = True
        logprob = delta.logprobs[0] if delta.logprobs else None
        aux = AuxRecord.from_token(entry.room, len(entry.prompt_ids), delta.new_token_ids[0], logprob)
        if self.sender is not None:
            self.sender.finish(entry.room, aux.encode())

    def _end(self, entry: _PrefillRoom, error: tuple[str, str] | None) -> None:
        """The room is over (or given up): free the KV, release the room, and tell the client if still waiting."""
        self._by_rid.pop(entry.rid, None)
        self._by_room.pop(entry.room, None)
        if entry.finished:
            self.engine.release_held(entry.rid)
        elif entry.in_engine:
            if error is not None:
                self.engine.fail_request(entry.rid, error[0], error[1])
            else:
                self.engine.abort_request(entry.rid)
            self.engine.release_held(entry.rid)
        elif error is not None:
            self._deltas.append(error_delta(entry.rid, error[0], error[1], len(entry.prompt_ids)))
        if self.sender is not None:
            self.sender.release(entry.room)
        if error is not None:
            logger.info("prefill request %s (room %d) failed: %s", entry.rid, entry.room, error[1])

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "bootstrap_port": self.bootstrap_server.port}

    def _control_endpoint(self) -> str:
        return self.sender.endpoint if self.sender is not None else ""

    # -- stats, shutdown --
    def _disagg_stats(self) -> DisaggStats:
        stats = self._transfer_stats(self.sender)
        for reason, n in self.bootstrap_server.rejected.items():  # bootstrap requests refused count here too
            stats.rejected_by_reason[reason] = stats.rejected_by_reason.get(reason, 0) + n
        stats.num_bootstrapping_reqs = sum(1 for e in self._by_rid.values() if not e.in_engine)
        stats.num_inflight_reqs = len(self.engine.scheduler.held)
        return stats

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.bootstrap_server.close()
            self.transport.close()
