"""A rank group: one engine process per rank on one node, rank 0 talking to the api, ranks 1..N-1 its children.

What every multi-rank layout shares, whatever the ranks do with the api's messages: the device of each rank,
the torch.distributed rendezvous (`init_rank`), launching and watching ranks 1..N-1 (`RankSupervisor`), and the
bodies of rank 0 (`run_group_driver`, inside the engine process) and of the other ranks (`run_group_worker`).
How the ranks share the work is the caller's `RankLoops`: the loop rank 0 runs, the loop the others run, and
the module whose `python -m` starts them. Tensor parallelism's lockstep loops are decode_server/runtime/tp_ranks.py,
data-parallel attention's decode_server/runtime/dp_ranks.py.

Layout (`--tp-size N`): the api process spawns rank 0 (the engine process, decode_server/runtime/engine_process.py);
rank 0 resolves the model (generating `tiny-dsa` once), launches ranks 1..N-1 as its own children, and all N
join one torch.distributed group (NCCL on CUDA plus a gloo `cpu_group`; gloo only on CPU). Every rank builds the
same `Engine(config, parallel=state)`: its model shard, its own device pools, and the node's one shared HiSparse
host pool.

Supervision: ranks 1..N-1 die with rank 0 (parent-death signal, and they exit when their parent changes); a
thread of rank 0 watches them, and when one exits unexpectedly it tells the api (`FatalMsg`), ends the others and
exits, which is the engine-death path of a single engine process (/health 503, in-flight requests end with an
error, the server exits non-zero). A collective that fails (a peer vanished) or outlasts `--watchdog-timeout`
raises on the ranks waiting in it, with the same result.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from decode_server.config import EngineConfig
from decode_server.parallel.state import ParallelState, destroy_parallel, init_parallel
from decode_server.runtime.death_note import write_note
from decode_server.runtime.describe import describe_engine
from decode_server.runtime.heartbeat import run_with_heartbeat
from decode_server.runtime.lifetime import die_with_parent, leave_signals_to_parent, load_factory
from decode_server.runtime.loop import EngineLoop
from decode_server.runtime.messages import FatalMsg, ReadyMsg, encode

logger = logging.getLogger(__name__)

SUPERVISE_PERIOD_S = 0.2
RANK_EXIT_TIMEOUT_S = 10.0
FATAL_LINGER_MS = 3000  # how long rank 0's supervisor waits to deliver its FatalMsg before it ends the process
CONFIG_ENV = "DECODE_SERVER_ENGINE_CONFIG"  # how rank 0 hands the config to ranks 1..N-1


# ---------------------------------------------------------------------------------------------- set-up helpers


def group_size(config: EngineConfig) -> int:
    """Engine processes in the group: `--tp-size` (as in SGLang, data-parallel attention splits these same ranks
    into attention replicas rather than adding processes)."""
    return config.tp_size


def check_rank_devices(config: EngineConfig) -> None:
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
    """Join the group; returns this rank's `ParallelState`."""
    device = rank_device(config, rank)  # init_parallel makes it the current CUDA device
    if device.type == "cpu":
        # Ranks share the host's cores: one rank's threads per core share, or their spin-waits starve each other.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // group_size(config)))
    return init_parallel(rank, config.tp_size, config.ep_size, init_method, device,
                         timeout_s=config.watchdog_timeout, dp_size=config.dp_attention_size,
                         enable_dp_lm_head=config.enable_dp_lm_head)  # fmt: skip


def build_rank_engine(config: EngineConfig, parallel: ParallelState, engine_factory: str) -> Any:
    return load_factory(engine_factory)(config, parallel=parallel)


def leave_group(parallel: ParallelState, engine: Any | None) -> None:
    """Release the engine's CUDA graphs, then leave the process group (in this order: a graph holding NCCL
    collectives makes `destroy_process_group` wait forever)."""
    if engine is not None:
        try:
            engine.close()
        except Exception:
            logger.exception("releasing the engine's CUDA graphs failed; leaving the process group anyway")
    with contextlib.suppress(Exception):
        destroy_parallel(parallel)


# ---------------------------------------------------------------------------------------------- how ranks share work


@dataclass(frozen=True)
class RankLoops:
    """How the ranks of a group share the work.

    `driver(engine, pull, push, parent_pid, parallel, config, supervisor)`: rank 0's loop, which alone receives
    the api's messages (its sockets `pull`/`push`) and must set `supervisor.stopping` when it stops on a shutdown;
    `follower(engine, parent_pid, parallel, config, reply_address)`: the loop of ranks 1..N-1 (`reply_address`:
    the api's socket, for loops whose ranks answer the api themselves); `worker_module`: the module whose
    `python -m` runs ranks 1..N-1 (it calls `run_group_worker` with these loops); `kind`: what the ranks are
    called in logs and errors ("tensor-parallel rank 1 (pid …) died")."""

    driver: Callable[..., EngineLoop]
    follower: Callable[..., EngineLoop]
    worker_module: str
    kind: str = "tensor-parallel"


# ---------------------------------------------------------------------------------------------- rank 0


class RankSupervisor:
    """Rank 0's children, ranks 1..N-1: launched, watched by a thread, ended with rank 0."""

    def __init__(self, config: EngineConfig, init_method: str, log_level: str, engine_factory: str,
                 fatal_address: str, ctx: zmq.Context, worker_module: str,
                 kind: str = "tensor-parallel") -> None:  # fmt: skip
        self.config = config
        self.kind = kind
        self.init_method = init_method
        self.log_level = log_level
        self.engine_factory = engine_factory
        self.fatal_address = fatal_address
        self.ctx = ctx
        self.worker_module = worker_module
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.stopping = False
        self.failure: str | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        config_json = self.config.model_dump_json()
        for rank in range(1, group_size(self.config)):
            args = [sys.executable, "-m", self.worker_module, "--rank", str(rank), "--init-method",
                    self.init_method, "--parent-pid", str(os.getpid()), "--log-level", self.log_level,
                    "--engine-factory", self.engine_factory, "--reply-address", self.fatal_address]  # fmt: skip
            env = dict(os.environ, **{CONFIG_ENV: config_json})
            self.procs[rank] = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL)
            logger.info("%s rank %d started (pid %d)", self.kind, rank, self.procs[rank].pid)
        self._thread = threading.Thread(target=self._watch, name="rank-supervisor", daemon=True)
        self._thread.start()

    @property
    def pids(self) -> list[int]:
        return [os.getpid()] + [p.pid for _, p in sorted(self.procs.items())]

    def dead_rank(self) -> str | None:
        for rank, proc in sorted(self.procs.items()):
            code = proc.poll()
            if code is not None:
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                return f"{self.kind} rank {rank} (pid {proc.pid}) died ({how})"
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
                write_note(self.fatal_address, reason, replace=True)  # survives the os._exit below
                # A fresh connection: under load it may take a while to come up, and os._exit below drops whatever
                # this socket (and rank 0's main thread) has not delivered yet — so linger long enough to deliver.
                sock = self.ctx.socket(zmq.PUSH)
                with contextlib.suppress(zmq.ZMQError):
                    sock.connect(self.fatal_address)
                    sock.send(encode(FatalMsg(reason)))
                sock.close(linger=FATAL_LINGER_MS)
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
                logger.warning("%s rank %d (pid %d) did not exit; killing it", self.kind, rank, proc.pid)
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)


def run_group_driver(config: EngineConfig, ctx: zmq.Context, pull: zmq.Socket, push: zmq.Socket,
                     from_engine_addr: str, parent_pid: int, log_level: str, engine_factory: str,
                     loops: RankLoops) -> int:  # fmt: skip
    """Rank 0's body inside the engine process (sockets already connected); returns the exit code."""
    from decode_server.model import resolve_model_path

    supervisor: RankSupervisor | None = None
    parallel = None
    engine = None
    loop: EngineLoop | None = None
    exit_code = 0
    try:
        check_rank_devices(config)
        resolve_model_path(config.model_path)  # generate tiny-dsa here once, before any rank reads it
        init_method = f"tcp://127.0.0.1:{free_tcp_port()}"
        supervisor = RankSupervisor(config, init_method, log_level, engine_factory, from_engine_addr, ctx,
                                    loops.worker_module, loops.kind)  # fmt: skip
        supervisor.start()
        parallel = init_rank(config, 0, init_method)
        engine = build_rank_engine(config, parallel, engine_factory)
        loop = loops.driver(engine, pull, push, parent_pid, parallel, config, supervisor)
        info = describe_engine(engine, config, loop.role)
        info.update(tp_size=config.tp_size, ep_size=config.ep_size, tp_rank_pids=supervisor.pids,
                    host_pool_shared=bool(config.enable_hisparse) and not config.enable_dp_attention)  # fmt: skip
        info.update(loop.group_info())
        push.send(encode(ReadyMsg(os.getpid(), info)))
        run_with_heartbeat(loop, ctx, from_engine_addr, config.watchdog_timeout)
    except Exception as exc:
        reason = supervisor.failure_reason() if supervisor is not None else None
        message = reason or f"{type(exc).__name__}: {exc}"
        logger.error("%s rank 0 failed: %s", loops.kind, message, exc_info=reason is None)
        write_note(from_engine_addr, message, replace=reason is not None)
        with contextlib.suppress(zmq.ZMQError):
            push.send(encode(FatalMsg(message)))
        exit_code = 1
    finally:
        if loop is not None:
            loop.close()
        if supervisor is not None:
            supervisor.terminate(RANK_EXIT_TIMEOUT_S if exit_code == 0 else 0.5)
        if parallel is not None and exit_code == 0:
            leave_group(parallel, engine)
        push.close(linger=1000)
        pull.close(linger=0)
        ctx.term()
    return exit_code


# ---------------------------------------------------------------------------------------------- ranks 1..N-1


def run_group_worker(argv: list[str] | None, loops: RankLoops) -> int:
    """Body of ranks 1..N-1 (launched by rank 0's `RankSupervisor` only); returns the exit code."""
    parser = argparse.ArgumentParser(prog=loops.worker_module)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--engine-factory", required=True)
    parser.add_argument("--reply-address", default=None, help="the api's socket (loops whose ranks answer it)")
    args = parser.parse_args(argv)
    die_with_parent()
    if os.getppid() != args.parent_pid:  # rank 0 died before the parent-death signal was armed
        return 1
    leave_signals_to_parent()  # rank 0 decides when the group stops
    logging.basicConfig(level=args.log_level.upper(), force=True,
                        format=f"%(asctime)s %(levelname)s engine rank {args.rank} %(name)s: %(message)s")  # fmt: skip
    config = EngineConfig.model_validate_json(os.environ[CONFIG_ENV])
    parallel = init_rank(config, args.rank, args.init_method)
    engine = None
    loop: EngineLoop | None = None
    try:
        engine = build_rank_engine(config, parallel, args.engine_factory)
        loop = loops.follower(engine, args.parent_pid, parallel, config, args.reply_address)
        loop.run()
    except Exception:
        if os.getppid() == args.parent_pid:
            logger.exception("%s rank %d failed", loops.kind, args.rank)
        return 1
    finally:
        if loop is not None:
            loop.close()
    leave_group(parallel, engine)
    return 0
