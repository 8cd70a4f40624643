"""Tensor-parallel engine ranks: one engine process per rank, driven in lockstep by rank 0.

Layout (`--tp-size N`): the api process spawns rank 0 (today's engine process, `engine_process.py`); rank 0
resolves the model (generating `tiny-dsa` once), launches ranks 1..N-1 as its own children
(`python -m decode_server.api.tp_ranks`), and all N join one torch.distributed group (NCCL on CUDA plus a gloo
`cpu_group`; gloo only on CPU). Every rank builds the same `Engine(config, parallel=state)`: its model shard, its
own device pools, and the node's one shared HiSparse host pool.

Every loop iteration rank 0 drains the api's messages (new requests, aborts, stats queries, shutdown), gives each
sampled request without a seed one drawn from `--random-seed`'s stream, and broadcasts the list over `cpu_group`
(`broadcast_object_list`); every rank applies the same messages in the same order and then calls
`engine.step()`, so their schedulers, pools and samplers stay identical. Only rank 0 answers the api (acceptances,
deltas, stats, heartbeats). A stats query is a collective: every rank's counters, pool usage and a running digest
of the tokens it produced are gathered into `EngineStats.tp_ranks`, so divergence is visible.

Supervision: ranks 1..N-1 die with rank 0 (parent-death signal, and they exit when their parent changes); a
thread of rank 0 watches them, and when one exits unexpectedly it tells the api (`FatalMsg`), ends the others and
exits, which is the engine-death path of a single engine process (/health 503, in-flight requests end with an
error, the server exits non-zero). A collective that fails (a peer vanished) or outlasts `--watchdog-timeout`
raises on the ranks waiting in it, with the same result.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import zmq

from decode_server.api.engine_process import (
    EngineLoop,
    _die_with_parent,
    _load_factory,
    describe_engine,
    run_with_heartbeat,
)
from decode_server.api.messages import FatalMsg, GenerateMsg, ReadyMsg, ToEngine, decode_to_engine, encode
from decode_server.config import EngineConfig
from decode_server.engine.sampler import is_greedy
from decode_server.engine.types import TPRankStats
from decode_server.parallel.state import ParallelState, destroy_parallel, init_parallel

logger = logging.getLogger("decode_server.tp_ranks")

SUPERVISE_PERIOD_S = 0.2
RANK_EXIT_TIMEOUT_S = 10.0


# ---------------------------------------------------------------------------------------------- set-up helpers


def check_tp_devices(config: EngineConfig) -> None:
    """`--tp-size N` on CUDA needs N visible GPUs (rank r uses cuda:r); on CPU every rank shares the host."""
    if config.tp_size <= 1 or config.device == "cpu":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (config.device == "cuda" or count > 0) and count < config.tp_size:
        raise ValueError(f"--tp-size {config.tp_size} needs {config.tp_size} visible GPUs (one per rank); {count} "
                         "visible (CUDA_VISIBLE_DEVICES)")


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    from decode_server.engine.memory import resolve_device

    device = resolve_device(config)
    return torch.device("cuda", rank) if device.type == "cuda" else device


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_rank(config: EngineConfig, rank: int, init_method: str) -> ParallelState:
    """Join the tensor-parallel group; returns this rank's `ParallelState`."""
    device = rank_device(config, rank)  # init_parallel makes it the current CUDA device
    if device.type == "cpu":
        # Ranks share the host's cores: one rank's threads per core share, or their spin-waits starve each other.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tp_size))
    return init_parallel(rank, config.tp_size, config.ep_size, init_method, device,
                         timeout_s=config.watchdog_timeout)  # fmt: skip


def build_engine(config: EngineConfig, parallel: Any, engine_factory: str) -> Any:
    return _load_factory(engine_factory)(config, parallel=parallel)


# ---------------------------------------------------------------------------------------------- the loops


class _NoReplies:
    """The reply socket of ranks > 0: only rank 0 talks to the api."""

    def send(self, data: bytes, *args: Any) -> None:
        pass


class _TPLoop(EngineLoop):
    """What every rank does alike: apply a broadcast list of messages, step, digest what it produced."""

    def __init__(self, engine: Any, pull: Any, push: Any, parent_pid: int | None, parallel: Any) -> None:
        super().__init__(engine, pull, push, parent_pid)
        self.parallel = parallel
        self._digest = hashlib.blake2b(digest_size=8)

    def _apply(self, msgs: list[ToEngine]) -> None:
        for msg in msgs:
            self._handle(msg)
            if self.stopping:
                return

    def _broadcast(self, msgs: list[ToEngine] | None) -> list[ToEngine]:
        box: list[Any] = [msgs]
        dist.broadcast_object_list(box, src=0, group=self.parallel.cpu_group)
        return list(box[0])

    def _on_deltas(self, deltas: list[Any]) -> None:
        for delta in deltas:
            self._digest.update(f"{delta.rid}:{delta.new_token_ids}:{delta.finished};".encode())
        super()._on_deltas(deltas)

    def _rank_stats(self) -> TPRankStats:
        stats = self.engine.stats()
        return TPRankStats(
            tp_rank=self.parallel.tp_rank, pid=os.getpid(), num_steps=stats.num_steps,
            num_generated_tokens=stats.num_generated_tokens, token_digest=self._digest.hexdigest(),
            host_pages_used=stats.host_pages.used, device_slots_used=stats.device_slots.used,
            indexer_slots_used=stats.indexer_slots.used, dense_kv_slots_used=stats.dense_kv_slots.used,
        )  # fmt: skip

    def _stats(self) -> Any:
        """Collective: every rank's view goes to rank 0, which reports them beside its own stats."""
        mine = self._rank_stats()
        gathered: list[Any] | None = [None] * self.parallel.tp_size if self.parallel.tp_rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=self.parallel.cpu_group)
        stats = self.engine.stats()
        if gathered is not None:
            stats.tp_ranks = list(gathered)
        return stats


class DriverLoop(_TPLoop):
    """Rank 0: the api's messages, seeded and broadcast, then applied here like everywhere."""

    def __init__(self, engine: Any, pull: Any, push: Any, parent_pid: int | None, parallel: Any,
                 seed: int, supervisor: RankSupervisor) -> None:  # fmt: skip
        super().__init__(engine, pull, push, parent_pid, parallel)
        self._seeds = random.Random(seed)
        self.supervisor = supervisor

    def _handle(self, msg: ToEngine) -> None:
        super()._handle(msg)
        if self.stopping:  # a shutdown: the other ranks exit now too, which is no failure
            self.supervisor.stopping = True

    def _receive(self) -> None:
        msgs: list[ToEngine] = []
        if self.pull.poll(self._poll_timeout_ms()):
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


class FollowerLoop(_TPLoop):
    """Ranks 1..N-1: rank 0's messages from the broadcast, no replies."""

    def __init__(self, engine: Any, parent_pid: int | None, parallel: Any) -> None:
        super().__init__(engine, None, _NoReplies(), parent_pid, parallel)

    def _receive(self) -> None:
        self._apply(self._broadcast(None))


# ---------------------------------------------------------------------------------------------- rank 0


class RankSupervisor:
    """Rank 0's children, ranks 1..N-1: launched, watched by a thread, ended with rank 0."""

    def __init__(self, config: EngineConfig, init_method: str, log_level: str, engine_factory: str,
                 fatal_address: str, ctx: zmq.Context) -> None:  # fmt: skip
        self.config = config
        self.init_method = init_method
        self.log_level = log_level
        self.engine_factory = engine_factory
        self.fatal_address = fatal_address
        self.ctx = ctx
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.stopping = False
        self.failure: str | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        config_json = self.config.model_dump_json()
        for rank in range(1, self.config.tp_size):
            args = [sys.executable, "-m", "decode_server.api.tp_ranks", "--rank", str(rank), "--init-method",
                    self.init_method, "--parent-pid", str(os.getpid()), "--log-level", self.log_level,
                    "--engine-factory", self.engine_factory]  # fmt: skip
            env = dict(os.environ, DECODE_SERVER_ENGINE_CONFIG=config_json)
            self.procs[rank] = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL)
            logger.info("tensor-parallel rank %d started (pid %d)", rank, self.procs[rank].pid)
        self._thread = threading.Thread(target=self._watch, name="tp-supervisor", daemon=True)
        self._thread.start()

    @property
    def pids(self) -> list[int]:
        return [os.getpid()] + [p.pid for _, p in sorted(self.procs.items())]

    def dead_rank(self) -> str | None:
        for rank, proc in sorted(self.procs.items()):
            code = proc.poll()
            if code is not None:
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                return f"tensor-parallel rank {rank} (pid {proc.pid}) died ({how})"
        return None

    def failure_reason(self, wait_s: float = 1.0) -> str | None:
        """Why the group broke, if a rank is gone (waits a little: a collective may notice before the exit)."""
        deadline = time.monotonic() + wait_s
        while True:
            reason = self.dead_rank()
            if reason is not None or time.monotonic() >= deadline:
                return reason
            time.sleep(0.05)

    def _watch(self) -> None:
        while not self.stopping:
            reason = self.dead_rank()
            if reason is not None and not self.stopping:
                self.failure = reason
                logger.error("%s; ending the engine", reason)
                sock = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 1000)
                with contextlib.suppress(zmq.ZMQError):
                    sock.connect(self.fatal_address)
                    sock.send(encode(FatalMsg(reason)))
                sock.close(linger=1000)
                self.terminate()
                os._exit(1)
            time.sleep(SUPERVISE_PERIOD_S)

    def terminate(self, timeout_s: float = RANK_EXIT_TIMEOUT_S) -> None:
        """Wait up to `timeout_s` for the ranks to exit (after a shutdown broadcast they do), then kill them."""
        self.stopping = True
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        for rank, proc in self.procs.items():
            if proc.poll() is None:
                logger.warning("tensor-parallel rank %d (pid %d) did not exit; killing it", rank, proc.pid)
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)


def run_driver_process(config: EngineConfig, ctx: zmq.Context, pull: zmq.Socket, push: zmq.Socket,
                       from_engine_addr: str, parent_pid: int, log_level: str, engine_factory: str) -> int:  # fmt: skip
    """Rank 0's body inside the engine process (sockets already connected); returns the exit code."""
    from decode_server.model import resolve_model_path

    supervisor: RankSupervisor | None = None
    parallel = None
    exit_code = 0
    try:
        check_tp_devices(config)
        resolve_model_path(config.model_path)  # generate tiny-dsa here once, before any rank reads it
        init_method = f"tcp://127.0.0.1:{free_tcp_port()}"
        supervisor = RankSupervisor(config, init_method, log_level, engine_factory, from_engine_addr, ctx)
        supervisor.start()
        parallel = init_rank(config, 0, init_method)
        engine = build_engine(config, parallel, engine_factory)
        info = describe_engine(engine, config)
        info.update(tp_size=config.tp_size, ep_size=config.ep_size, tp_rank_pids=supervisor.pids,
                    host_pool_shared=bool(config.enable_hisparse))  # fmt: skip
        push.send(encode(ReadyMsg(os.getpid(), info)))
        run_with_heartbeat(DriverLoop(engine, pull, push, parent_pid, parallel, config.seed, supervisor), ctx,
                           from_engine_addr, config.watchdog_timeout)
    except Exception as exc:
        reason = supervisor.failure_reason() if supervisor is not None else None
        message = reason or f"{type(exc).__name__}: {exc}"
        logger.error("tensor-parallel rank 0 failed: %s", message, exc_info=reason is None)
        with contextlib.suppress(zmq.ZMQError):
            push.send(encode(FatalMsg(message)))
        exit_code = 1
    finally:
        if supervisor is not None:
            supervisor.terminate(RANK_EXIT_TIMEOUT_S if exit_code == 0 else 0.5)
        if parallel is not None and exit_code == 0:
            _leave_group(parallel)
        push.close(linger=1000)
        pull.close(linger=0)
        ctx.term()
    return exit_code


def _leave_group(parallel: ParallelState) -> None:
    with contextlib.suppress(Exception):
        destroy_parallel(parallel)


# ---------------------------------------------------------------------------------------------- ranks 1..N-1


def worker_main(argv: list[str] | None = None) -> int:
    """Entry point of ranks 1..N-1 (launched by rank 0 only)."""
    parser = argparse.ArgumentParser(prog="decode_server.api.tp_ranks")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--engine-factory", required=True)
    args = parser.parse_args(argv)
    _die_with_parent()
    if os.getppid() != args.parent_pid:  # rank 0 died before the parent-death signal was armed
        return 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    logging.basicConfig(level=args.log_level.upper(), force=True,
                        format=f"%(asctime)s %(levelname)s engine rank {args.rank} %(name)s: %(message)s")  # fmt: skip
    config = EngineConfig.model_validate_json(os.environ["DECODE_SERVER_ENGINE_CONFIG"])
    parallel = init_rank(config, args.rank, args.init_method)
    try:
        engine = build_engine(config, parallel, args.engine_factory)
        FollowerLoop(engine, args.parent_pid, parallel).run()
    except Exception:
        if os.getppid() == args.parent_pid:
            logger.exception("tensor-parallel rank %d failed", args.rank)
        return 1
    _leave_group(parallel)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
