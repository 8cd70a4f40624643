"""Tensor-parallel ranks in lockstep: every rank applies the same api messages in the same order, then steps.

The group itself (devices, rendezvous, launching and supervising ranks 1..N-1) is decode_server/runtime/rank_group.py;
this module is how tensor-parallel ranks share the work (`LOCKSTEP_LOOPS`) and the `python -m` entry of ranks
1..N-1 (`python -m decode_server.runtime.tp_ranks`, launched by rank 0 only).

Every loop iteration rank 0 drains the api's messages (new requests, aborts, stats queries, shutdown), gives each
sampled request without a seed one drawn from `--random-seed`'s stream, and broadcasts the list over `cpu_group`
(`broadcast_object_list`); every rank applies the same messages in the same order and then calls
`engine.step()`, so their schedulers, pools and samplers stay identical. Only rank 0 answers the api (acceptances,
deltas, stats, heartbeats). A stats query is a collective: every rank's counters, pool usage and a running digest
of the tokens it produced are gathered into `EngineStats.tp_ranks`, so divergence is visible.

A PD decode server (`--disaggregation-mode decode`) runs a decode role on every rank over the same lockstep:
rank 0's alone talks to prefill and receives each prompt's KV into memory every rank maps; how each room ended
(`RoleOutcome`) joins the next broadcast, ahead of the api's messages, and every rank applies it there (installs
the rows, commits the first token, or fails the request), so the ranks stay identical
(decode_server/disagg/decode_role.py). A PD prefill server works the same way: rank 0 alone runs the bootstrap
server and the sender, and sends the rows of its own cache (every rank computes the same KV); when decode's
destination arrives or a transfer ends, every rank admits or frees the request together
(decode_server/disagg/prefill_role.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import sys
import time
from typing import Any

import torch.distributed as dist
import zmq

from decode_server.config import EngineConfig
from decode_server.disagg.role import RoleOutcome
from decode_server.engine.sampler import is_greedy
from decode_server.engine.types import TPRankStats
from decode_server.parallel.state import ParallelState
from decode_server.runtime.loop import EngineLoop
from decode_server.runtime.messages import GenerateMsg, ToEngine, decode_to_engine
from decode_server.runtime.rank_group import RankLoops, RankSupervisor, run_group_driver, run_group_worker
from decode_server.runtime.roles import build_role


class _NoReplies:
    """The reply socket of ranks > 0: only rank 0 talks to the api."""

    def send(self, data: bytes, *args: Any) -> None:
        pass


class LockstepLoop(EngineLoop):
    """What every rank does alike: apply a broadcast list of messages, step, digest what it produced."""

    def __init__(self, engine: Any, pull: Any, push: Any, parent_pid: int | None, parallel: ParallelState,
                 config: EngineConfig | None = None) -> None:  # fmt: skip
        pd = config is not None and config.disaggregation.enabled
        role = build_role(engine, config.disaggregation, lockstep=parallel) if pd else None
        super().__init__(engine, pull, push, parent_pid, role)
        self.parallel = parallel
        self._digest = hashlib.blake2b(digest_size=8)

    def _apply(self, msgs: list[Any]) -> None:
        for msg in msgs:
            self._handle(msg)
            if self.stopping:
                return

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, RoleOutcome):  # rank 0's reading of a PD room, applied by every rank here
            delta = self.role.apply_outcome(msg)
            if delta is not None:
                self._on_deltas([delta])
            return
        super()._handle(msg)

    def _broadcast(self, msgs: list[Any] | None) -> list[Any]:
        box: list[Any] = [msgs]
        dist.broadcast_object_list(box, src=0, group=self.parallel.cpu_group)
        return list(box[0])

    def _on_deltas(self, deltas: list[Any]) -> None:
        for delta in deltas:
            self._digest.update(f"{delta.rid}:{delta.new_token_ids}:{delta.finished};".encode())
        super()._on_deltas(deltas)

    def close(self) -> None:
        if self.role is not None:
            self.role.close()

    def _rank_stats(self) -> TPRankStats:
        stats = self.engine.stats()
        memory = getattr(self.role, "memory", None)  # a PD decode role's staging rows
        return TPRankStats(
            tp_rank=self.parallel.tp_rank, pid=os.getpid(), num_steps=stats.num_steps,
            num_generated_tokens=stats.num_generated_tokens, token_digest=self._digest.hexdigest(),
            host_pages_used=stats.host_pages.used, device_slots_used=stats.device_slots.used,
            indexer_slots_used=stats.indexer_slots.used, dense_kv_slots_used=stats.dense_kv_slots.used,
            pd_staging_rows_used=memory.staging_usage().used if memory is not None else 0,
        )  # fmt: skip

    def _stats(self) -> Any:
        """Collective: every rank's view goes to rank 0, which reports them beside its own stats."""
        mine = self._rank_stats()
        gathered: list[Any] | None = [None] * self.parallel.tp_size if self.parallel.tp_rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=self.parallel.cpu_group)
        stats = self.role.stats() if self.role is not None else self.engine.stats()
        if gathered is not None:
            stats.tp_ranks = list(gathered)
        return stats


class DriverLoop(LockstepLoop):
    """Rank 0: the api's messages, seeded and broadcast, then applied here like everywhere."""

    def __init__(self, engine: Any, pull: zmq.Socket, push: zmq.Socket, parent_pid: int | None,
                 parallel: ParallelState, config: EngineConfig, supervisor: RankSupervisor) -> None:  # fmt: skip
        super().__init__(engine, pull, push, parent_pid, parallel, config)
        self._seeds = random.Random(config.seed)
        self.supervisor = supervisor

    def _handle(self, msg: Any) -> None:
        super()._handle(msg)
        if self.stopping:  # a shutdown: the other ranks exit now too, which is no failure
            self.supervisor.stopping = True

    def _receive(self) -> None:
        timeout = self._poll_timeout_ms()  # 0 while PD outcomes wait for the broadcast
        # PD rooms that ended at the last step go first: every rank applies them before anything else.
        msgs: list[Any] = self.role.take_outcomes() if self.role is not None else []
        if self.pull.poll(timeout):
            while True:
                try:
                    data = self.pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msgs.append(self._seeded(decode_to_engine(data)))
        # A broadcast every iteration, even an empty one, keeps the ranks in step; a hung peer shows as a long
        # "step" to the heartbeat's watchdog.
        self.step_started = time.monotonic()
        try:
            self._apply(self._broadcast(msgs))
        finally:
            self.step_started = None

    def _seeded(self, msg: ToEngine) -> ToEngine:
        """A sampled request without a seed gets one here, before the broadcast: every rank's generator for it
        is then the same, and so is every token it samples."""
        if isinstance(msg, GenerateMsg) and msg.params.seed is None and not is_greedy(msg.params):
            params = msg.params.model_copy(update={"seed": self._seeds.getrandbits(63)})
            return dataclasses.replace(msg, params=params)
        return msg


class FollowerLoop(LockstepLoop):
    """Ranks 1..N-1: rank 0's messages from the broadcast, no replies."""

    def __init__(self, engine: Any, parent_pid: int | None, parallel: ParallelState,
                 config: EngineConfig | None = None, reply_address: str | None = None) -> None:  # fmt: skip
        super().__init__(engine, None, _NoReplies(), parent_pid, parallel, config)

    def _receive(self) -> None:
        self._apply(self._broadcast(None))


# `__name__` is "__main__" in ranks 1..N-1, so the module is named here.
LOCKSTEP_LOOPS = RankLoops(driver=DriverLoop, follower=FollowerLoop, worker_module="decode_server.runtime.tp_ranks")


def run_driver(config: EngineConfig, ctx: zmq.Context, pull: zmq.Socket, push: zmq.Socket, from_engine_addr: str,
               parent_pid: int, log_level: str, engine_factory: str) -> int:  # fmt: skip
    """Rank 0 of a tensor-parallel group, inside the engine process; returns the exit code."""
    return run_group_driver(config, ctx, pull, push, from_engine_addr, parent_pid, log_level, engine_factory,
                            LOCKSTEP_LOOPS)  # fmt: skip


def worker_main(argv: list[str] | None = None) -> int:
    """Entry point of ranks 1..N-1 (launched by rank 0 only)."""
    return run_group_worker(argv, LOCKSTEP_LOOPS)


if __name__ == "__main__":
    sys.exit(worker_main())
