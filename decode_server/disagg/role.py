"""What the engine process's loop asks of a PD role and the pieces both roles share.

The engine process picks the role of `--disaggregation-mode` (`decode_server.runtime.roles.build_role`);
the roles import this module, never the other way round."""

from __future__ import annotations

import bisect
import logging
import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from decode_server.config import DisaggregationConfig
from decode_server.disagg.bootstrap_info import BootstrapInfo
from decode_server.engine.sampling_params import SamplingParams
from decode_server.engine.types import KV_TRANSFER_LATENCY_BUCKETS, DisaggStats, EngineStats, RequestDelta
from decode_server.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# How long the engine loop may block on its socket while only PD transfers are awaited (their results are
# polled between waits, so this bounds the latency a transfer's end adds).
PD_WAIT_MS = 2


def advertised_host(cfg: DisaggregationConfig) -> str:
    """The address peers reach us at: --host, unless it is a wildcard (then this machine's name's address)."""
    if cfg.host in ("", "0.0.0.0", "::"):
        return socket.gethostbyname(socket.gethostname())
    return cfg.host


def make_transport(cfg: DisaggregationConfig) -> Any:
    from transfer.mooncake_transport import MooncakeTransport

    protocol = "rdma" if cfg.ib_device else "tcp"
    return MooncakeTransport(advertised_host(cfg), protocol, cfg.ib_device, cfg.transfer_timeout_s)


def make_auth(cfg: DisaggregationConfig) -> Any:
    """The PD control plane's authentication (`transfer.auth.PDAuth`), or None without a secret (warned loudly)."""
    from transfer.auth import PDAuth

    auth = PDAuth.from_file(cfg.auth_secret_file)
    if auth is None:
        logger.warning("PD control plane NOT authenticated (no --disaggregation-auth-secret-file): any process "
                       "that reaches this server's bootstrap or control ports can steer KV transfers and read "
                       "prompts' KV; set a secret shared by the prefill and decode servers and the router "
                       "(docs/pd.md, 'Authentication and threat model')")
    return auth


def require_bootstrap(bootstrap: BootstrapInfo | None, mode: str) -> BootstrapInfo:
    if bootstrap is None:
        raise InvalidRequestError(
            f"this server runs with --disaggregation-mode {mode}: a request needs 'bootstrap_host', "
            "'bootstrap_port' and 'bootstrap_room' (a PD router adds them)", param="bootstrap_room",
        )
    return bootstrap


def error_delta(rid: str, error_class: str, message: str, prompt_tokens: int = 0) -> RequestDelta:
    return RequestDelta(rid=rid, finished=True, finish_reason="abort", prompt_tokens=prompt_tokens,
                        error=message, error_class=error_class)


@dataclass(frozen=True)
class RoleOutcome:
    """Base of what rank 0's PD role reads from its transfer engine for a tensor-parallel group: the group's loop
    broadcasts it ahead of the api's messages and every rank applies it (`PDRole.apply_outcome`) at the same
    point, so their engines stay identical (decode_server/runtime/tp_ranks.py)."""


class LatencyHistogram:
    """Cumulative transfer-latency histogram fed with the transfer package's samples."""

    def __init__(self) -> None:
        self.counts = [0] * (len(KV_TRANSFER_LATENCY_BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0

    def add(self, samples: list[float]) -> None:
        for s in samples:
            self.counts[bisect.bisect_left(KV_TRANSFER_LATENCY_BUCKETS, s)] += 1
            self.sum += s
            self.count += 1


class PDRole(ABC):
    """Base of both roles: owns the transport's lifetime and the PD part of the stats."""

    mode = "null"

    def __init__(self, engine: Any, cfg: DisaggregationConfig, parallel: Any = None) -> None:
        """`parallel`: the ranks of a tensor-parallel group in lockstep (rank 0 alone talks to the peers), or None
        for one engine (and for each rank of DP attention, which talks to its own peers)."""
        self.engine = engine
        self.cfg = cfg
        self.lockstep = parallel is not None and parallel.tp_size > 1
        self.talks = not self.lockstep or parallel.tp_rank == 0  # this rank runs the transfer engine
        self._outcomes: list[RoleOutcome] = []
        self.latency = LatencyHistogram()
        self.transport: Any = None
        self.layout: Any = None
        self.auth: Any = None  # transfer.auth.PDAuth with a cluster secret

    # -- called by the engine loop --
    @abstractmethod
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams,
                    bootstrap: BootstrapInfo | None) -> None:
        """Implemented by PrefillRole and DecodeRole."""

    @abstractmethod
    def abort(self, rid: str) -> None:
        """Implemented by PrefillRole and DecodeRole."""

    @abstractmethod
    def step(self) -> list[RequestDelta]:
        """Implemented by PrefillRole and DecodeRole."""

    @abstractmethod
    def has_pending(self) -> bool:
        """Rooms in flight: the loop must keep polling (briefly) even when the engine has nothing to compute."""

    def take_outcomes(self) -> list[RoleOutcome]:
        """Rank 0 of a tensor-parallel group: the outcomes read since the last call, for the loop to broadcast
        (every rank, this one included, then applies them with `apply_outcome`); nothing for a role alone."""
        out, self._outcomes = self._outcomes, []
        return out

    @abstractmethod
    def apply_outcome(self, outcome: RoleOutcome) -> RequestDelta | None:
        """Apply one of rank 0's outcomes (every rank of a tensor-parallel group, or the only rank at once): the
        request's first delta, if the outcome gives one. Implemented by PrefillRole and DecodeRole."""

    def _settle(self, outcome: RoleOutcome) -> RequestDelta | None:
        """Apply an outcome now (one rank), or queue it for the broadcast (lockstep: every rank applies it then)."""
        if self.lockstep:
            self._outcomes.append(outcome)
            return None
        return self.apply_outcome(outcome)

    def poll_timeout_ms(self, idle_ms: int) -> int:
        if self.engine.has_runnable_work() or self._outcomes:
            return 0
        return PD_WAIT_MS if self.has_pending() else idle_ms

    def stats(self) -> EngineStats:
        stats = self.engine.stats()
        if self.talks:  # ranks 1..N-1 of a tensor-parallel group: rank 0 reports the transfers
            stats.disagg = self._disagg_stats()
        return stats

    @abstractmethod
    def close(self) -> None:
        """Implemented by PrefillRole and DecodeRole."""

    def describe(self) -> dict[str, Any]:
        """For the start-up log and /server_info."""
        return {"mode": self.mode, "session_id": self.transport.session_id, "layout": self.layout.to_dict(),
                "control_endpoint": self._control_endpoint(), "auth": "on" if self.auth is not None else "off"}

    def _control_endpoint(self) -> str:
        return ""

    # -- shared --
    def _transfer_stats(self, side: Any) -> DisaggStats:
        snap = side.stats.snapshot()
        self.latency.add(side.stats.take_latency_samples())
        registered = sum(self.transport.registered.values()) if self.transport is not None else 0
        return DisaggStats(
            mode=self.mode, rooms_by_state=side.num_rooms_by_state(), rooms_finished=snap["rooms_finished"],
            failures_by_cause=snap["failures"], transfer_bytes=snap["bytes_transferred"],
            latency_bucket_counts=list(self.latency.counts), latency_sum_s=self.latency.sum,
            latency_count=self.latency.count, registered_bytes=registered,
            rejected_by_reason=dict(snap.get("rejected", {})), auth=self.auth is not None,
        )

    @abstractmethod
    def _disagg_stats(self) -> DisaggStats:
        """Implemented by PrefillRole and DecodeRole."""
