"""The engine's heartbeat and watchdog: a thread beside the loop that tells the api the loop is alive.

It reports loop progress every `HEARTBEAT_PERIOD_S` on its own socket (ZMQ sockets are not thread-safe), and ends
the process when one step has run longer than `--watchdog-timeout` (SGLang's watchdog): a stuck step must not
leave a pod that looks alive. SIGSTOP stops this thread too, so the api reads any silence as "stopped or hung" and
has its own watchdog for that case (decode_server/api/engine_client.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import zmq

from decode_server.runtime.loop import EngineLoop
from decode_server.runtime.messages import FatalMsg, HeartbeatMsg, encode

logger = logging.getLogger(__name__)

HEARTBEAT_PERIOD_S = 0.5


class Heartbeat(threading.Thread):
    """Sends `HeartbeatMsg(pid, loop iterations, seconds the current step has run)` and runs the step watchdog."""

    def __init__(self, ctx: zmq.Context, address: str, loop: EngineLoop, watchdog_timeout: float) -> None:
        super().__init__(name="engine-heartbeat", daemon=True)
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 16)
        self.socket.connect(address)
        self.loop = loop
        self.watchdog_timeout = watchdog_timeout
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop.wait(HEARTBEAT_PERIOD_S):
                started = self.loop.step_started
                running = time.monotonic() - started if started is not None else 0.0
                if running > self.watchdog_timeout:
                    logger.error("engine step running for %.0f s (watchdog timeout %.0f s); exiting", running,
                                 self.watchdog_timeout)  # fmt: skip
                    with contextlib.suppress(zmq.ZMQError):
                        self.socket.send(encode(FatalMsg(f"watchdog: one engine step ran for {running:.0f} s")),
                                         zmq.NOBLOCK)  # fmt: skip
                    time.sleep(0.2)
                    os._exit(3)
                with contextlib.suppress(zmq.ZMQError):
                    self.socket.send(encode(HeartbeatMsg(os.getpid(), self.loop.num_loops, running)), zmq.NOBLOCK)
        finally:
            self.socket.close(linger=0)


def run_with_heartbeat(loop: EngineLoop, ctx: zmq.Context, address: str, watchdog_timeout: float) -> None:
    """Run an engine loop (a single engine's or a rank group's driver) with its heartbeat thread, which is stopped
    and joined however the loop ends."""
    heartbeat = Heartbeat(ctx, address, loop, watchdog_timeout)
    heartbeat.start()
    try:
        loop.run()
    finally:
        heartbeat.stop.set()
        heartbeat.join(timeout=2)
