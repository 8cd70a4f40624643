"""Data-parallel attention ranks: each rank serves its own requests; rank 0 hands every rank the api's messages.

The group itself (devices, rendezvous, launching and supervising ranks 1..N-1) is decode_server/runtime/rank_group.py;
this module is how DP-attention ranks share the work (`DP_LOOPS`) and the `python -m` entry of ranks 1..N-1
(`python -m decode_server.runtime.dp_ranks`, launched by rank 0 only).

Every loop iteration, on every rank:
1. rank 0 drains the api's messages and broadcasts them over `cpu_group` (an empty list too, so ranks move in
   step); it blocks on the api's socket (up to 100 ms) only when the last step showed every rank idle;
2. each rank applies what concerns it: the requests the api assigned to it (`GenerateMsg.dp_rank`; the api
   balances them by load), aborts of its own requests, stats queries (a collective), shutdown;
3. each rank calls `step()` (its PD role's, or its engine's), work or not: the step agrees on the pass with the
   others (`DPStepSync`: every rank's token counts, and how soon each wants its next iteration), runs this rank's
   batch or an idle pass so that the MLPs' collectives meet, or nothing when no rank has a token;
4. each rank answers the api itself, over its own socket to the api's (acceptances, refusals, deltas): a request
   lives on one rank, so its messages stay in order. Rank 0 alone sends heartbeats and stats.

A stats query gathers every rank's `EngineStats` to rank 0, which reports their sums with each rank's load and
pools in `EngineStats.dp_ranks` (/metrics: `dp_rank` label). With `--disaggregation-mode decode` every rank runs
its own decode role: its own transfer engine and receiver, registering its own memory, so a prefill server writes a
request's KV straight into the rank that serves it (each rank's destination is in /server_info `dp_ranks`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
import zmq

from decode_server.config import EngineConfig
from decode_server.engine.types import (
    DisaggStats,
    DPRankStats,
    EngineStats,
    HiSparseLayerStats,
    PoolUsage,
    PrefixCacheStats,
)
from decode_server.errors import InvalidRequestError
from decode_server.parallel.state import ParallelState
from decode_server.runtime.loop import EngineLoop
from decode_server.runtime.messages import (
    AbortMsg,
    FlushCacheMsg,
    FlushedMsg,
    GenerateMsg,
    RejectedMsg,
    StatsMsg,
    StatsQueryMsg,
    ToEngine,
    decode_to_engine,
    encode,
)
from decode_server.runtime.rank_group import RankLoops, RankSupervisor, run_group_driver, run_group_worker
from decode_server.runtime.roles import build_role

KIND = "data-parallel attention"


class DPRankLoop(EngineLoop):
    """What every DP rank does alike: its own requests from the broadcast messages, a step every iteration."""

    def __init__(self, engine: Any, pull: Any, push: Any, parent_pid: int | None, parallel: ParallelState,
                 config: EngineConfig) -> None:  # fmt: skip
        role = build_role(engine, config.disaggregation) if config.disaggregation.enabled else None
        super().__init__(engine, pull, push, parent_pid, role)
        self.parallel = parallel
        self.config = config
        self.rank = parallel.dp_rank
        self.sync = engine.dp_sync
        # Collective: every rank's pid and PD destination, for rank 0's ready report.
        self.ranks_info = self._gather({"dp_rank": self.rank, "pid": os.getpid(),
                                        **({"disaggregation": role.describe()} if role is not None else {})})

    def _gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.parallel.dp_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.parallel.cpu_group)
        return out

    def _broadcast(self, msgs: list[ToEngine] | None) -> list[ToEngine]:
        box: list[Any] = [msgs]
        dist.broadcast_object_list(box, src=0, group=self.parallel.cpu_group)
        return list(box[0])

    def _apply(self, msgs: list[ToEngine]) -> None:
        for msg in msgs:
            self._handle(msg)
            if self.stopping:
                return
        # How soon this rank wants the next iteration; shared by the step's agreement (rank 0 polls on it).
        self.sync.hint = self._poll_timeout_ms()

    def _should_step(self) -> bool:
        return True  # the step's agreement and the MLPs' collectives need every rank, busy or idle

    def _handle(self, msg: ToEngine) -> None:
        if isinstance(msg, GenerateMsg) and not 0 <= msg.dp_rank < self.parallel.dp_size and self.rank == 0:
            self.push.send(encode(RejectedMsg.from_exception(msg.rid, InvalidRequestError(
                f"data-parallel rank {msg.dp_rank} does not exist (dp_size {self.parallel.dp_size})"))))
            return
        if isinstance(msg, GenerateMsg) and msg.dp_rank != self.rank:
            return
        if isinstance(msg, AbortMsg) and msg.rid is not None and msg.rid not in self.active:
            return
        if isinstance(msg, StatsQueryMsg):
            stats = self._stats()  # a collective: every rank takes part
            if stats is not None:
                self.push.send(encode(StatsMsg(msg.query_id, stats)))
            return
        if isinstance(msg, FlushCacheMsg):  # every rank flushes its own cache; rank 0 reports the sum
            dropped = self._gather(self.engine.flush_prefix_cache())
            if dropped is not None:
                self.push.send(encode(FlushedMsg(msg.query_id, sum(dropped))))
            return
        super()._handle(msg)

    def _stats(self) -> Any:
        stats = self.role.stats() if self.role is not None else self.engine.stats()
        gathered = self._gather((os.getpid(), stats))
        return merge_rank_stats(gathered) if gathered is not None else None

    def close(self) -> None:
        if self.role is not None:
            self.role.close()


class DriverLoop(DPRankLoop):
    """Rank 0: the api's messages, broadcast to every rank, then applied here like everywhere."""

    def __init__(self, engine: Any, pull: zmq.Socket, push: zmq.Socket, parent_pid: int | None,
                 parallel: ParallelState, config: EngineConfig, supervisor: RankSupervisor) -> None:  # fmt: skip
        super().__init__(engine, pull, push, parent_pid, parallel, config)
        self.supervisor = supervisor

    def group_info(self) -> dict[str, Any]:
        return {"enable_dp_attention": True, "dp_size": self.parallel.dp_size,
                "enable_dp_lm_head": self.config.enable_dp_lm_head,
                "load_balance_method": self.config.load_balance_method, "dp_ranks": self.ranks_info}

    def _handle(self, msg: ToEngine) -> None:
        super()._handle(msg)
        if self.stopping:  # a shutdown: the other ranks exit now too, which is no failure
            self.supervisor.stopping = True

    def _receive(self) -> None:
        # Block on the api's socket only when every rank was idle at the last step (their hints) and so is this one.
        timeout = min(self._poll_timeout_ms(), *self.sync.hints[1:])
        msgs: list[ToEngine] = []
        if self.pull.poll(timeout):
            while True:
                try:
                    data = self.pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msgs.append(decode_to_engine(data))
        # A broadcast every iteration, even an empty one, keeps the ranks in step; a hung peer shows as a long
        # "step" to the heartbeat's watchdog.
        self.step_started = time.monotonic()
        try:
            self._apply(self._broadcast(msgs))
        finally:
            self.step_started = None


class FollowerLoop(DPRankLoop):
    """Ranks 1..N-1: rank 0's messages from the broadcast; answers go to the api over this rank's own socket."""

    def __init__(self, engine: Any, parent_pid: int | None, parallel: ParallelState, config: EngineConfig,
                 reply_address: str | None = None) -> None:  # fmt: skip
        if reply_address is None:
            raise ValueError("a data-parallel attention rank needs the api's address to answer its requests")
        self._ctx = zmq.Context()
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(reply_address)
        self._socket = push
        try:
            super().__init__(engine, None, push, parent_pid, parallel, config)
        except BaseException:
            self._close_socket()
            raise

    def _receive(self) -> None:
        self._apply(self._broadcast(None))

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._close_socket()

    def _close_socket(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._socket.close(linger=1000)
            self._ctx.term()


# ---------------------------------------------------------------------------------------------- stats


def _sum_pools(pools: list[PoolUsage]) -> PoolUsage:
    return PoolUsage(used=sum(p.used for p in pools), total=sum(p.total for p in pools))


def _sum_dicts(dicts: list[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _merge_disagg(parts: list[DisaggStats]) -> DisaggStats:
    """Counters and gauges of every rank's PD role, summed (each rank receives its own requests' KV)."""
    first = parts[0]
    buckets = [sum(col) for col in zip(*(p.latency_bucket_counts for p in parts), strict=True)]
    return DisaggStats(
        mode=first.mode, auth=first.auth,
        num_bootstrapping_reqs=sum(p.num_bootstrapping_reqs for p in parts),
        num_inflight_reqs=sum(p.num_inflight_reqs for p in parts),
        num_transferring_reqs=sum(p.num_transferring_reqs for p in parts),
        num_prealloc_reqs=sum(p.num_prealloc_reqs for p in parts),
        rooms_by_state=_sum_dicts([p.rooms_by_state for p in parts]),
        rooms_finished=_sum_dicts([p.rooms_finished for p in parts]),
        failures_by_cause=_sum_dicts([p.failures_by_cause for p in parts]),
        transfer_bytes=sum(p.transfer_bytes for p in parts), latency_bucket_counts=buckets,
        latency_sum_s=sum(p.latency_sum_s for p in parts), latency_count=sum(p.latency_count for p in parts),
        staging_rows=_sum_pools([p.staging_rows for p in parts]),
        aux_rows_used=sum(p.aux_rows_used for p in parts),
        registered_bytes=sum(p.registered_bytes for p in parts),
        rejected_by_reason=_sum_dicts([p.rejected_by_reason for p in parts]),
    )  # fmt: skip


def _sum_known(values: Iterable[int | None]) -> int | None:
    """The sum of the ranks' values, None where no rank has one (a layer without a bets' counterfactual)."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def merge_rank_stats(gathered: list[tuple[int, EngineStats]]) -> EngineStats:
    """The group's stats: every count and pool summed over the ranks (token usage averaged: the ranks' pools are
    the same size), rank 0's weights, and each rank's own load and pools in `dp_ranks`."""
    stats = [s for _, s in gathered]
    first = stats[0]
    layers = []
    for i, layer in enumerate(first.hisparse_layers):
        same = [s.hisparse_layers[i] for s in stats]
        layers.append(HiSparseLayerStats(layer=layer.layer, hits=sum(x.hits for x in same),
                                         misses=sum(x.misses for x in same),
                                         speculative_hits=sum(x.speculative_hits for x in same),
                                         speculative_misses=sum(x.speculative_misses for x in same),
                                         speculative_rows_saved=_sum_known(x.speculative_rows_saved for x in same),
                                         bytes_h2d=sum(x.bytes_h2d for x in same),
                                         bytes_d2h=sum(x.bytes_d2h for x in same)))  # fmt: skip
    disaggs = [s.disagg for s in stats if s.disagg is not None]
    return EngineStats(
        num_running_reqs=sum(s.num_running_reqs for s in stats),
        num_queue_reqs=sum(s.num_queue_reqs for s in stats),
        num_retracted_reqs=sum(s.num_retracted_reqs for s in stats),
        token_usage=sum(s.token_usage for s in stats) / len(stats),
        num_generated_tokens=sum(s.num_generated_tokens for s in stats),
        num_prompt_tokens=sum(s.num_prompt_tokens for s in stats),
        num_steps=sum(s.num_steps for s in stats),
        num_retractions=sum(s.num_retractions for s in stats),
        num_idle_passes=sum(s.num_idle_passes for s in stats),
        hisparse_enabled=first.hisparse_enabled, hisparse_layers=layers,
        host_pages=_sum_pools([s.host_pages for s in stats]),
        device_slots=_sum_pools([s.device_slots for s in stats]),
        indexer_slots=_sum_pools([s.indexer_slots for s in stats]),
        dense_kv_slots=_sum_pools([s.dense_kv_slots for s in stats]),
        quantization=first.quantization, weights_bytes=first.weights_bytes,
        weights_bytes_by_kind=first.weights_bytes_by_kind,
        disagg=_merge_disagg(disaggs) if disaggs else None,
        prefix_cache=_sum_prefix_caches([s.prefix_cache for s in stats if s.prefix_cache is not None]),
        dp_ranks=[
            DPRankStats(
                dp_rank=rank, pid=pid, num_running_reqs=s.num_running_reqs, num_queue_reqs=s.num_queue_reqs,
                num_retracted_reqs=s.num_retracted_reqs, token_usage=s.token_usage, num_steps=s.num_steps,
                num_idle_passes=s.num_idle_passes, num_generated_tokens=s.num_generated_tokens,
                host_pages=s.host_pages, device_slots=s.device_slots, indexer_slots=s.indexer_slots,
                dense_kv_slots=s.dense_kv_slots,
                kv_transfer_bytes=s.disagg.transfer_bytes if s.disagg is not None else 0,
            )
            for rank, (pid, s) in enumerate(gathered)
        ],
    )  # fmt: skip


def _sum_prefix_caches(caches: list[PrefixCacheStats]) -> PrefixCacheStats | None:
    """Each DP rank has its own prefix cache: the group's is their sum (the hit rate follows from the sums)."""
    if not caches:
        return None
    summed = {name: sum(getattr(c, name) for c in caches) for name in PrefixCacheStats.model_fields
              if name != "page_size"}
    return PrefixCacheStats(**summed, page_size=caches[0].page_size)


# `__name__` is "__main__" in ranks 1..N-1, so the module is named here.
DP_LOOPS = RankLoops(driver=DriverLoop, follower=FollowerLoop, worker_module="decode_server.runtime.dp_ranks",
                     kind=KIND)


def run_driver(config: EngineConfig, ctx: zmq.Context, pull: zmq.Socket, push: zmq.Socket, from_engine_addr: str,
               parent_pid: int, log_level: str, engine_factory: str) -> int:  # fmt: skip
    """Rank 0 of a data-parallel-attention group, inside the engine process; returns the exit code."""
    return run_group_driver(config, ctx, pull, push, from_engine_addr, parent_pid, log_level, engine_factory,
                            DP_LOOPS)  # fmt: skip


def worker_main(argv: list[str] | None = None) -> int:
    """Entry point of ranks 1..N-1 (launched by rank 0 only)."""
    return run_group_worker(argv, DP_LOOPS)


if __name__ == "__main__":
    sys.exit(worker_main())
