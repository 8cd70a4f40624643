"""The router's HTTP surface: the OpenAI routes proxied to a worker pair, plus /health, /metrics, /v1/models."""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from decode_server.api.auth import ApiKeyMiddleware
from decode_server.api.errors import error_body, install_error_handlers
from decode_server.router.config import RouterConfig
from decode_server.router.metrics import RouterMetrics
from decode_server.router.proxy import CHAT, COMPLETIONS, Dispatcher
from decode_server.router.workers import WORKER_ERRORS, Worker, WorkerPool

logger = logging.getLogger(__name__)


def _worker_info(w: Worker) -> dict[str, Any]:
    info: dict[str, Any] = {"url": w.url, "healthy": w.healthy, "inflight": w.inflight}
    if w.role == "prefill":
        info["bootstrap_port"] = w.bootstrap_port
    if not w.healthy and w.last_error:
        info["last_error"] = w.last_error
    if w.load:
        info["load"] = w.load
    return info


def create_app(config: RouterConfig, pool: WorkerPool, dispatcher: Dispatcher, metrics: RouterMetrics) -> FastAPI:
    app = FastAPI(
        title="HiSparse Decode Server PD router",
        description="OpenAI front door of a prefill/decode deployment",
        version="0.1.0",
    )
    install_error_handlers(app)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)

    # The body is read and validated by the dispatcher (with the servers' own request models), so that it is
    # parsed once and forwarded as it came; the OpenAPI schema therefore shows these routes without a body model.
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await dispatcher.handle(request, COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await dispatcher.handle(request, CHAT)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """The model list of a healthy decode worker (every worker serves the same model)."""
        headers = {k: v for k in ("authorization", "x-api-key") if (v := request.headers.get(k))}
        timeout = aiohttp.ClientTimeout(total=config.health_check_timeout_secs)
        for worker in pool.healthy("decode"):
            try:
                async with dispatcher.client.get(worker.url + "/v1/models", headers=headers, timeout=timeout) as resp:
                    body = await resp.read()
            except WORKER_ERRORS as exc:
                logger.warning("GET /v1/models from %s failed: %r", worker.url, exc)
                continue
            return Response(body, status_code=resp.status, media_type=resp.headers.get("content-type"))
        return JSONResponse(error_body("no healthy decode worker", "workers_unavailable", 503), status_code=503,
                            headers={"Retry-After": "1"})  # fmt: skip

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 when at least one prefill and one decode worker are healthy; 503 otherwise."""
        workers = {"prefill": [_worker_info(w) for w in pool.prefill],
                   "decode": [_worker_info(w) for w in pool.decode]}  # fmt: skip
        if pool.ready:
            return JSONResponse({"status": "ok", "workers": workers})
        missing = " and ".join(r for r in ("prefill", "decode") if not pool.healthy(r))  # type: ignore[arg-type]
        body = error_body(f"no healthy {missing} worker", "workers_unavailable", 503)
        return JSONResponse(dict(body, workers=workers), status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
