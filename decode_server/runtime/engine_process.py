"""The engine process: `Engine` (or rank 0 of a rank group) in a loop fed by ZMQ, dying with its parent.

Spawned by the api's `EngineClient.start` with multiprocessing's spawn method (a fresh interpreter: CUDA and forked
torch threads do not mix). It must not outlive the api process: Linux's parent-death signal kills it if the parent
dies abruptly, and the loop also exits when its parent pid changes.

With `--tp-size 1` this process is the engine: it builds it (and its PD role with `--disaggregation-mode`), says
`ReadyMsg`, and runs `EngineLoop` (decode_server/runtime/loop.py) with its heartbeat. With `--tp-size N` it is rank 0
of N engine processes (decode_server/runtime/tp_ranks.py, decode_server/runtime/rank_group.py); with
`--enable-dp-attention` rank 0 of N data-parallel-attention ranks (decode_server/runtime/dp_ranks.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import zmq

from decode_server.config import EngineConfig
from decode_server.runtime.death_note import write_note
from decode_server.runtime.describe import describe_engine
from decode_server.runtime.heartbeat import run_with_heartbeat
from decode_server.runtime.lifetime import die_with_parent, leave_signals_to_parent, load_factory
from decode_server.runtime.loop import EngineLoop
from decode_server.runtime.messages import FatalMsg, ReadyMsg, encode
from decode_server.runtime.roles import build_role

logger = logging.getLogger(__name__)

DEFAULT_ENGINE_FACTORY = "decode_server.engine.engine:Engine"


def run_engine_process(
    config: EngineConfig,
    to_engine_addr: str,
    from_engine_addr: str,
    parent_pid: int,
    log_level: str = "info",
    engine_factory: str = DEFAULT_ENGINE_FACTORY,
) -> None:
    """Process entry point (spawned by `EngineClient.start`)."""
    die_with_parent()
    # The api process owns Ctrl-C: it asks us to stop over the socket, so a terminal's SIGINT to the whole
    # process group must not kill the engine mid-step.
    leave_signals_to_parent()
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s engine %(name)s: %(message)s", force=True
    )
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    pull.connect(to_engine_addr)
    push.connect(from_engine_addr)
    if config.enable_dp_attention:
        from decode_server.runtime.dp_ranks import run_driver as run_dp_driver

        # Rank 0 of a data-parallel-attention group: launches and supervises the other ranks.
        sys.exit(run_dp_driver(config, ctx, pull, push, from_engine_addr, parent_pid, log_level, engine_factory))
    if config.tp_size > 1:
        from decode_server.runtime.tp_ranks import run_driver

        # Rank 0 of a tensor-parallel group: launches and supervises the other ranks.
        sys.exit(run_driver(config, ctx, pull, push, from_engine_addr, parent_pid, log_level, engine_factory))
    exit_code = 0
    role = None
    try:
        engine = load_factory(engine_factory)(config)
        if config.disaggregation.enabled:
            role = build_role(engine, config.disaggregation)
        push.send(encode(ReadyMsg(os.getpid(), describe_engine(engine, config, role))))
        run_with_heartbeat(EngineLoop(engine, pull, push, parent_pid, role), ctx, from_engine_addr,
                           config.watchdog_timeout)
    except Exception as exc:
        logger.exception("engine process failed")
        write_note(from_engine_addr, f"{type(exc).__name__}: {exc}", replace=False)
        with contextlib.suppress(zmq.ZMQError):
            push.send(encode(FatalMsg(f"{type(exc).__name__}: {exc}")))
        exit_code = 1
    finally:
        if role is not None:
            with contextlib.suppress(Exception):
                role.close()
        push.close(linger=1000)
        pull.close(linger=0)
        ctx.term()
    sys.exit(exit_code)
