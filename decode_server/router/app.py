"""The router's HTTP surface: the generation routes proxied to a worker pair, plus /health, /metrics, /v1/models.

POSTs to /v1/completions, /v1/chat/completions and /generate (SGLang's native API) — the traffic — go straight
from the ASGI entry to the dispatcher, which validates the body with the servers' own request models; every other
request (probes, metrics, the model list, unknown routes) goes through a FastAPI app and its OpenAI-style error
handlers. The generation paths with a trailing slash get the 307 redirect to the path without it that the servers
(Starlette's `redirect_slashes`) give, so a client that works against a server works against the router.
"""

from __future__ import annotations

import logging
import os
from typing import Any
from urllib.parse import quote

import aiohttp
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, RedirectResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import URL
from starlette.types import ASGIApp, Receive, Scope, Send

from decode_server.api.auth import ApiKeyMiddleware
from decode_server.api.errors import error_body, install_error_handlers
from decode_server.router.config import RouterConfig
from decode_server.router.metrics import RouterMetrics
from decode_server.router.proxy import CHAT, COMPLETIONS, GENERATE, Dispatcher, Route
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


class RouterApp:
    """The ASGI entry: the generation routes to the dispatcher, the rest to the FastAPI app."""

    def __init__(self, api: FastAPI, dispatcher: Dispatcher) -> None:
        self.api = api
        self.dispatcher = dispatcher
        self.routes: dict[str, Route] = {r.path: r for r in (COMPLETIONS, CHAT, GENERATE)}
        self.slashed: dict[str, Route] = {route.path + "/": route for route in self.routes.values()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (route := self.routes.get(scope["path"])) is not None:
            if scope["method"] == "POST":
                await self.dispatcher.handle(scope, receive, send, route)
            else:
                response = JSONResponse(error_body("Method Not Allowed", "invalid_request_error", 405),
                                        status_code=405, headers={"Allow": "POST"})  # fmt: skip
                await response(scope, receive, send)
            return
        if scope["type"] == "http" and (route := self.slashed.get(scope["path"])) is not None:
            # As Starlette's redirect_slashes does for the servers: 307 keeps the method and the body.
            await RedirectResponse(URL(scope=scope).replace(path=route.path), status_code=307)(scope, receive, send)
            return
        await self.api(scope, receive, send)


def _schema_only(model: type[Any]) -> Any:
    async def relay(body: Any) -> None:
        raise AssertionError("served by RouterApp, never by FastAPI")

    relay.__annotations__ = {"body": model, "return": None}  # the model object itself, not a string to resolve
    return relay


def _document_generation_routes(app: FastAPI) -> None:
    """List the generation routes in /openapi.json with the servers' request models. `RouterApp` answers
    them before FastAPI sees the request, so these routes exist only in the schema (`app.openapi` reads the
    routes it is given, not the ones served)."""
    docs = FastAPI()
    for route in (COMPLETIONS, CHAT, GENERATE):
        docs.post(route.path, summary="Relayed to a prefill/decode pair: decode's answer (JSON, or SSE with "
                  "`stream: true`)")(_schema_only(route.model))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                             routes=[*docs.routes, *app.routes])
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(config: RouterConfig, pool: WorkerPool, dispatcher: Dispatcher, metrics: RouterMetrics,
               process_index: int = 0) -> ASGIApp:  # fmt: skip
    """`process_index`: which of the `config.router_processes` processes this is (reported by /health: each
    process checks the workers itself, so the worker states /health shows are that process's view)."""
    app = FastAPI(
        title="HiSparse Decode Server PD router",
        description="OpenAI front door of a prefill/decode deployment",
        version="0.1.0",
    )
    install_error_handlers(app)

    async def from_a_decode_worker(path: str, request: Request) -> Response:
        """A healthy decode worker's answer to GET `path` (every worker serves the same model)."""
        headers = {} if config.worker_api_key else {
            k: v for k in ("authorization", "x-api-key") if (v := request.headers.get(k))}  # fmt: skip
        timeout = aiohttp.ClientTimeout(total=config.health_check_timeout_secs)
        for worker in pool.healthy("decode"):
            try:
                async with dispatcher.client.get(worker.url + path, headers=headers, timeout=timeout) as resp:
                    body = await resp.read()
            except WORKER_ERRORS as exc:
                logger.warning("GET %s from %s failed: %r", path, worker.url, exc)
                continue
            return Response(body, status_code=resp.status, media_type=resp.headers.get("content-type"))
        return JSONResponse(error_body("no healthy decode worker", "workers_unavailable", 503), status_code=503,
                            headers={"Retry-After": "1"})  # fmt: skip

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """The model list of a healthy decode worker."""
        return await from_a_decode_worker("/v1/models", request)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        """OpenAI's model retrieval, answered by a healthy decode worker."""
        return await from_a_decode_worker("/v1/models/" + quote(model_id, safe="/"), request)

    @app.get("/get_model_info")
    async def get_model_info(request: Request) -> Response:
        """SGLang's model info (what its frontend reads before /generate), from a healthy decode worker."""
        return await from_a_decode_worker("/get_model_info", request)

    process = {"index": process_index, "count": config.router_processes, "pid": os.getpid()}

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 when at least one prefill and one decode worker are healthy (in the view of the router process
        that answers); 503 otherwise."""
        workers = {"prefill": [_worker_info(w) for w in pool.prefill],
                   "decode": [_worker_info(w) for w in pool.decode]}  # fmt: skip
        auth = "on" if dispatcher.auth is not None else "off"
        if pool.ready:
            return JSONResponse({"status": "ok", "workers": workers, "router_process": process,
                                 "disaggregation_auth": auth})  # fmt: skip
        missing = " and ".join(r for r in ("prefill", "decode") if not pool.healthy(r))  # type: ignore[arg-type]
        body = error_body(f"no healthy {missing} worker", "workers_unavailable", 503)
        return JSONResponse(dict(body, workers=workers, router_process=process, disaggregation_auth=auth),
                            status_code=503)  # fmt: skip

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    _document_generation_routes(app)
    entry: ASGIApp = RouterApp(app, dispatcher)
    if config.api_key:
        entry = ApiKeyMiddleware(entry, api_key=config.api_key)
    return entry
