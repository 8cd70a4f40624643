"""Run the router: one asyncio process (uvicorn), one pooled HTTP client, health and load loops.

The event loop is uvloop and uvicorn's HTTP parser httptools when they are installed (they are dependencies of
the project; without them: asyncio's loop and h11): the router's cost per request is mostly event-loop and
HTTP-framing work, which these do in C.

SIGINT/SIGTERM stop it: uvicorn stops accepting, open streams get a few seconds to end, the requests still
running at the workers are aborted (the relays send `/abort_request` when they are cancelled), then exit 0.
"""

from __future__ import annotations

import asyncio
import gc
import logging

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
from decode_server.router.config import RouterConfig
from decode_server.router.metrics import RouterMetrics
from decode_server.router.proxy import Dispatcher
from decode_server.router.workers import WorkerPool

logger = logging.getLogger("decode_server.router")

GRACEFUL_SHUTDOWN_S = 5
ABORT_DRAIN_S = 3.0


def make_client(config: RouterConfig) -> aiohttp.ClientSession:
    """One connection pool for every worker: keep-alive connections, no cap on concurrent streams (a cap would
    queue the 65th stream behind the first 64; the workers bound their own load).

    aiohttp rather than httpx: httpcore's pool does work proportional to its connections on every request
    event, which at 64 concurrent streams per worker cost the router tens of milliseconds per request."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_secs,
                                    sock_read=config.request_timeout_secs)  # fmt: skip
    # No cookie jar: a cookie one client's answer set must never go with another client's request.
    return aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False,
                                 cookie_jar=aiohttp.DummyCookieJar())  # fmt: skip


async def serve(config: RouterConfig) -> int:
    metrics = RouterMetrics()
    async with make_client(config) as client:
        pool = WorkerPool(config, client, metrics)
        dispatcher = Dispatcher(config, pool, client, metrics)
        app = create_app(config, pool, dispatcher, metrics)
        pool.start()
        uv_config = uvicorn.Config(
            app, host=config.host, port=config.port, log_config=None, log_level=config.log_level,
            access_log=config.log_level == "debug", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            lifespan="off", backlog=4096, http=HTTP_IMPL, proxy_headers=False,
        )  # fmt: skip
        server = SignalHandlingServer(uv_config)
        logger.info(
            "PD router: policy %s, prefill %s, decode %s (event loop %s, HTTP %s)",
            config.policy,
            ", ".join(f"{w.url} (bootstrap port {w.bootstrap_port})" for w in config.prefill),
            ", ".join(w.url for w in config.decode),
            type(asyncio.get_running_loop()).__module__.split(".")[0], HTTP_IMPL,
        )
        logger.info("listening on http://%s:%d (OpenAI API under /v1)", config.host, config.port)
        # Everything built so far lives as long as the process: keep it out of the cyclic GC's full collections,
        # which otherwise walk every FastAPI, pydantic and prometheus object again and again under load.
        gc.freeze()
        try:
            await server.serve()
        finally:
            await pool.stop()
            await dispatcher.drain_background(ABORT_DRAIN_S)
    if not server.started:
        logger.error("the HTTP server failed to start (is port %d free?)", config.port)
        return 1
    logger.info("router stopped")
    return 0


def run(config: RouterConfig) -> int:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop if uvloop else None) as runner:
        return runner.run(serve(config))
