"""Run one router process: one asyncio loop (uvicorn), one pooled HTTP client, health and load loops.

With `--router-processes 1` this is the whole router; with N > 1 the supervisor (`supervisor.py`) runs N of
these, each serving a listening socket it was handed (`ChildContext`), and this module is what each of them runs.

The event loop is uvloop and uvicorn's HTTP parser httptools when they are installed (they are dependencies of
the project; without them: asyncio's loop and h11): the router's cost per request is mostly event-loop and
HTTP-framing work, which these do in C.

A process accepts connections only after its first round of health checks (bounded by the check timeout), so
that it does not answer "no healthy worker" in its first milliseconds.

SIGINT/SIGTERM stop it: uvicorn stops accepting, open streams get a few seconds to end, the requests still
running at the workers are aborted (the relays send `/abort_request` when they are cancelled), then exit 0.
A child of the supervisor handles SIGTERM only (the supervisor turns its own SIGINT into SIGTERM for every
child): Ctrl-C in a terminal reaches the whole process group, and a child that got the supervisor's SIGTERM on
top of the terminal's SIGINT would take the second signal as "force the exit" and skip the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import uvicorn

from decode_server.api.uvicorn_server import SignalHandlingServer

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency; Windows has none
    uvloop = None
try:
    import httptools  # noqa: F401  (only probed: uvicorn imports it itself)

    HTTP_IMPL = "httptools"
except ImportError:  # pragma: no cover
    HTTP_IMPL = "h11"

from decode_server.router.app import create_app
from decode_server.router.config import ABORT_DRAIN_S, GRACEFUL_SHUTDOWN_S, RouterConfig
from decode_server.router.metrics import RouterMetrics
from decode_server.router.proxy import Dispatcher
from decode_server.router.workers import WorkerPool

logger = logging.getLogger("decode_server.router")



def make_client(config: RouterConfig) -> aiohttp.ClientSession:
    """One connection pool for every worker: keep-alive connections, no cap on concurrent streams (a cap would
    queue the 65th stream behind the first 64; the workers bound their own load).

    aiohttp rather than httpx: httpcore's pool does work proportional to its connections on every request
    event, which at 64 concurrent streams per worker cost the router tens of milliseconds per request."""
    tls: ssl.SSLContext | bool = True  # https:// workers: verified with the system's CAs ...
    if config.ca_cert_path:  # ... or with the deployment's own CA
        tls = ssl.create_default_context(cafile=config.ca_cert_path)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60, ssl=tls)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_secs,
                                    sock_read=config.request_timeout_secs)  # fmt: skip
    # No cookie jar: a cookie one client's answer set must never go with another client's request.
    # --worker-api-key: on every worker call (generation, aborts, health, load, models).
    headers = {"Authorization": f"Bearer {config.worker_api_key}"} if config.worker_api_key else None
    return aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False, headers=headers,
                                 cookie_jar=aiohttp.DummyCookieJar())  # fmt: skip


@dataclass(frozen=True)
class ChildContext:
    """What the supervisor hands one of its router processes."""

    index: int  # 0 .. N-1, in logs and in /health
    sock: socket.socket  # listening already (SO_REUSEPORT, bound by the supervisor)
    metrics_dir: str  # the shared PROMETHEUS_MULTIPROC_DIR
    on_ready: Callable[[], None]  # tells the supervisor this process accepts connections


class RouterServer(SignalHandlingServer):
    """uvicorn that calls `on_started` once it accepts connections (the supervisor waits for every child)."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.on_started is not None:
            self.on_started()


async def serve(config: RouterConfig, child: ChildContext | None = None) -> int:
    metrics = RouterMetrics(child.metrics_dir if child else None)
    index = child.index if child else 0
    async with make_client(config) as client:
        pool = WorkerPool(config, client, metrics)
        dispatcher = Dispatcher(config, pool, client, metrics)
        app = create_app(config, pool, dispatcher, metrics, process_index=index)
        pool.start()
        with contextlib.suppress(TimeoutError):  # each check is bounded by the timeout; this is a safety net
            await asyncio.wait_for(pool.wait_first_check(), config.health_check_timeout_secs + 1.0)
        uv_config = uvicorn.Config(
            app, host=config.host, port=config.port, log_config=None, log_level=config.log_level,
            access_log=config.log_level == "debug", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            lifespan="off", backlog=4096, http=HTTP_IMPL, proxy_headers=False,
            ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile,
        )  # fmt: skip
        server = RouterServer(uv_config, on_started=child.on_ready if child else None)
        if child is not None:
            server.stop_signals = (signal.SIGTERM,)
        if index == 0:
            logger.info(
                "PD router: prefill %s (policy %s), decode %s (policy %s) (event loop %s, HTTP %s, %d process%s)",
                ", ".join(f"{w.url} (bootstrap port {w.bootstrap_port})" for w in config.prefill),
                config.resolved_prefill_policy,
                ", ".join(w.url for w in config.decode),
                config.resolved_decode_policy,
                type(asyncio.get_running_loop()).__module__.split(".")[0], HTTP_IMPL,
                config.router_processes, "" if config.router_processes == 1 else "es",
            )  # fmt: skip
            if dispatcher.auth is None:
                logger.warning("rooms are NOT signed (no --disaggregation-auth-secret-file): PD servers without a "
                               "secret accept any room; servers with one refuse this router's requests (docs/pd.md)")
        if child is None:
            logger.info("listening on %s://%s:%d (OpenAI API under /v1)", "https" if config.ssl_certfile else "http",
                        config.host, config.port)  # fmt: skip
        else:
            logger.debug("router process %d (pid %d) serving", index, os.getpid())
        # Everything built so far lives as long as the process: keep it out of the cyclic GC's full collections,
        # which otherwise walk every FastAPI, pydantic and prometheus object again and again under load.
        gc.freeze()
        try:
            await server.serve(sockets=[child.sock] if child else None)
        finally:
            await pool.stop()
            await dispatcher.drain_background(ABORT_DRAIN_S)
    if not server.started:
        logger.error("the HTTP server failed to start (is port %d free?)", config.port)
        return 1
    logger.info("router stopped" if child is None else f"router process {index} stopped")
    return 0


def run(config: RouterConfig, child: ChildContext | None = None) -> int:
    """One router process (the whole router, or one child of the supervisor)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop if uvloop else None) as runner:
        return runner.run(serve(config, child))
