"""uvicorn with the signal handling both of our servers need (the api server and the PD router).

uvicorn re-raises the stop signal after `serve()` returns, which would turn a clean stop into death by signal
(exit code 143). Here SIGINT / SIGTERM call `on_signal(sig)` instead and nothing is re-raised; each server says
in `on_signal` what the first and the second signal do (drain, abort, force the exit).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Generator

import uvicorn

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class SignalHandlingServer(uvicorn.Server):
    stop_signals: tuple[signal.Signals, ...] = STOP_SIGNALS  # a subclass may handle fewer (the router's children)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        loop = asyncio.get_running_loop()
        for sig in self.stop_signals:
            loop.add_signal_handler(sig, self.on_signal, sig)
        try:
            yield
        finally:
            for sig in self.stop_signals:
                loop.remove_signal_handler(sig)

    def on_signal(self, sig: int) -> None:
        """The first signal stops accepting and lets uvicorn finish (open streams get its graceful timeout); a
        second forces the exit without waiting for them."""
        if self.should_exit:
            logger.warning("second %s: forcing exit", signal.Signals(sig).name)
            self.force_exit = True
            return
        logger.info("%s received: shutting down", signal.Signals(sig).name)
        self.should_exit = True
