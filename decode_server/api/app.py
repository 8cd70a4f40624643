"""The FastAPI application: routes only; the work is in `serving.py`, `engine_client.py` and `metrics.py`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from decode_server.api.auth import ApiKeyMiddleware
from decode_server.api.engine_client import EngineClient
from decode_server.api.errors import error_body, install_error_handlers
from decode_server.api.generation import ChoiceSpec, GenerationGroup
from decode_server.api.limits import BodyLimitMiddleware, RejectionCounterMiddleware
from decode_server.api.metrics import ServerMetrics
from decode_server.api.native import NativeGeneration
from decode_server.api.native_protocol import GenerateRequest
from decode_server.api.protocol import (
    AbortRequestBody,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    random_id,
)
from decode_server.api.request_log import RequestLog
from decode_server.api.serving import ModelInfo, OpenAIServing
from decode_server.api.tokenization import TokenizerPool
from decode_server.api.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    Tokenization,
    TokenizeRequest,
    TokenizeResponse,
)
from decode_server.engine.sampling_params import SamplingParams
from decode_server.errors import DecodeServerError, EngineBusyError, EngineDeadError, InvalidRequestError

BUSY_STEP_S = 1.0  # /health reports "busy" while one engine step has run this long

logger = logging.getLogger(__name__)
T = TypeVar("T")

HEALTH_GENERATE_TIMEOUT_S = 60.0
STATS_TIMEOUT_S = 5.0

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "invalid request"},
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
    503: {
        "model": ErrorResponse,
        "description": "queue full, shutting down, or engine gone (see Retry-After)",
    },
}


@dataclass
class ServerContext:
    """Everything the routes use, built once at start-up by `server.py`."""

    client: EngineClient
    tokenizer: Any
    model: ModelInfo
    metrics: ServerMetrics
    engine_info: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    tokenizer_pool: TokenizerPool | None = None
    request_log: RequestLog | None = None  # --log-requests


def package_version() -> str:
    try:
        return _dist_version("hisparse-decode-server")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return "unknown"


def create_app(ctx: ServerContext) -> FastAPI:
    app = FastAPI(
        title="HiSparse Decode Server",
        description="OpenAI-compatible decode service for DSA models with a host-offloaded KV cache",
        version="0.1.0",
    )
    install_error_handlers(app)
    if ctx.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=ctx.api_key)
    app.add_middleware(BodyLimitMiddleware)
    app.add_middleware(RejectionCounterMiddleware, metrics=ctx.metrics)  # outermost: sees every refusal
    serving = OpenAIServing(ctx.client, ctx.tokenizer, ctx.metrics, ctx.model, ctx.tokenizer_pool, ctx.request_log)
    app.state.ctx = ctx
    app.state.serving = serving

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await _counted(ctx, serving.completions(body, request))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await _counted(ctx, serving.chat(body, request))

    native = NativeGeneration(serving)

    @app.post("/generate", responses=_ERRORS)
    async def generate(body: GenerateRequest, request: Request) -> Any:
        """SGLang's native generation API (decode_server/api/native.py)."""
        return await _counted(ctx, native.generate(body, request))

    tokenization = Tokenization(serving)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """vLLM's: the token ids of a prompt or of a conversation (decode_server/api/tokenize.py)."""
        return await tokenization.tokenize(body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        """vLLM's: the text of token ids."""
        return await tokenization.detokenize(body)

    def model_card() -> ModelCard:
        return ModelCard(
            id=ctx.model.served_model_name,
            root=str(ctx.engine_info.get("model_path", ctx.model.served_model_name)),
            max_model_len=ctx.model.context_length,
        )

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={404: {"description": "not served"}})
    async def model(model_id: str) -> ModelCard:
        """OpenAI's model retrieval (`client.models.retrieve`); the served name or the model path."""
        if model_id not in ctx.model.accepted_names:
            raise StarletteHTTPException(404, f"model '{model_id}' is not served here; this server serves "
                                              f"'{ctx.model.served_model_name}'")
        return model_card()

    @app.get("/version")
    async def version() -> dict[str, str]:
        """vLLM's: the server's package version."""
        return {"version": package_version()}

    @app.get("/health", responses={503: _ERRORS[503]})
    async def health() -> Response:
        """Liveness: 200 `{"status": "ok", "engine": "running" | "busy", ...}` while the engine process runs and
        sends heartbeats ("busy": one step has run for over a second); 503 with an OpenAI-style error once it
        died, stopped answering for the heartbeat timeout, or the server is stopping."""
        client = ctx.client
        if client.dead or client.closing or client.unresponsive:
            if client.dead:
                reason = f"engine process died ({client.death_reason})"
            elif client.closing:
                reason = "server shutting down"
            else:
                reason = f"engine process not responding (no heartbeat for {client.silence_s():.1f} s)"
            return JSONResponse(error_body(reason, "engine_unavailable", 503), status_code=503)
        return JSONResponse({
            "status": "ok",
            "engine": "busy" if client.step_running_s >= BUSY_STEP_S else "running",
            "engine_pid": client.pid,
            "last_heartbeat_s": round(client.silence_s(), 3),
            "step_running_s": round(client.step_running_s, 3),
        })

    @app.get("/health_generate", responses={503: _ERRORS[503]})
    async def health_generate() -> Response:
        """Readiness: generate one token end to end through the engine. A PD server cannot generate alone (it
        needs its peer): there the check is that the engine loop answers."""
        if ctx.model.disaggregation_mode != "null":
            try:
                await ctx.client.get_stats(STATS_TIMEOUT_S)
            except (TimeoutError, DecodeServerError) as exc:
                return JSONResponse(error_body(f"engine not responding: {exc}", "engine_unavailable", 503), 503)
            return JSONResponse({"status": "ok"})
        ids = ctx.tokenizer.encode("Hello") or [0]
        spec = ChoiceSpec(index=0, prompt_token_ids=ids[: max(1, ctx.model.context_length - 1)],
                          params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))  # fmt: skip
        group = GenerationGroup(ctx.client, ctx.metrics, random_id("health"), [spec])

        async def generate_one() -> None:
            await group.submit()
            async for _ in group.events():
                pass

        try:
            await asyncio.wait_for(generate_one(), HEALTH_GENERATE_TIMEOUT_S)
        except TimeoutError:
            return JSONResponse(error_body("health generation timed out", "engine_unavailable", 503), 503)
        except DecodeServerError as exc:
            status = exc.status_code if exc.status_code >= 500 else 503
            return JSONResponse(error_body(exc.message, exc.error_type, status), status_code=status)
        finally:
            group.abort_unfinished("health check ended")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        if not ctx.client.dead and not ctx.client.closing:
            try:
                ctx.metrics.latest_stats = await ctx.client.get_stats(STATS_TIMEOUT_S)
            except (TimeoutError, DecodeServerError) as exc:
                logger.warning("metrics: engine stats unavailable (%s); serving the last snapshot", exc)
        ctx.metrics.dp_inflight = ctx.client.dp_load()
        ctx.metrics.engine_alive = not ctx.client.dead
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        """SGLang's: what its clients (e.g. the `sglang` frontend's RuntimeEndpoint) read before /generate."""
        path = str(ctx.engine_info.get("model_path", ctx.model.served_model_name))
        return {"model_path": path, "tokenizer_path": path, "served_model_name": ctx.model.served_model_name,
                "is_generation": True, "context_length": ctx.model.context_length}

    @app.get("/server_info")
    @app.get("/get_server_info", include_in_schema=False)  # SGLang's older name
    async def server_info() -> dict[str, Any]:
        stats = await _answer_or_busy(ctx.client.get_stats(STATS_TIMEOUT_S), "sent no stats")
        return {
            "served_model_name": ctx.model.served_model_name,
            "context_length": ctx.model.context_length,
            "engine": ctx.engine_info,
            "engine_pid": ctx.client.pid,
            "num_inflight_requests": ctx.client.num_inflight,
            "dp_inflight_requests": ctx.client.dp_load()[0],
            # --load-balance-method cache_aware: how its choices went (hit / miss / imbalanced); None otherwise
            "dp_cache_aware_decisions": (dict(ctx.client.balancer.decisions)
                                         if ctx.client.balancer.affinity is not None else None),
            "disaggregation_auth": _auth_state(ctx.model),
            "stats": stats.model_dump(),
        }

    @app.get("/load", responses={503: _ERRORS[503]})
    async def load() -> dict[str, Any]:
        """What a router's least_load policy needs, as JSON: requests running and waiting, free host pages (prefix-
        cache pages no request uses count as free: they are given back as soon as a pool runs short)."""
        stats = await ctx.client.get_stats(STATS_TIMEOUT_S)
        cache = stats.prefix_cache
        evictable = cache.evictable_tokens if cache is not None else 0
        evictable_pages = evictable // cache.page_size if cache is not None and cache.page_size else 0
        return {
            "num_running_reqs": stats.num_running_reqs,
            "num_waiting_reqs": stats.num_queue_reqs,
            "num_inflight_requests": ctx.client.num_inflight,
            "host_pages_free": stats.host_pages.total - stats.host_pages.used + (
                evictable_pages if stats.host_pages.total else 0),
            "host_pages_total": stats.host_pages.total,
            "dense_kv_slots_free": stats.dense_kv_slots.total - stats.dense_kv_slots.used + (
                evictable if stats.dense_kv_slots.total else 0),
            "dense_kv_slots_total": stats.dense_kv_slots.total,
            "token_usage": stats.token_usage,
        }

    @app.post("/flush_cache", responses={503: _ERRORS[503]})
    async def flush_cache() -> dict[str, Any]:
        """SGLang's /flush_cache: drop every prefix-cache page no request uses (requests in flight keep theirs)."""
        dropped = await _answer_or_busy(ctx.client.flush_cache(STATS_TIMEOUT_S), "did not flush its prefix cache")
        return {"prefix_caching": ctx.model.prefix_caching, "dropped_tokens": dropped}

    @app.post("/abort_request", responses={400: _ERRORS[400]})
    async def abort_request(body: AbortRequestBody) -> dict[str, Any]:
        """Abort one request (`rid`: the id of a completion, e.g. `cmpl-…`) or all (`abort_all: true`)."""
        if body.abort_all:
            n = await ctx.client.abort_all("aborted by /abort_request")
            return {"aborted": n}
        if not body.rid:
            raise InvalidRequestError("give 'rid' (a request id) or 'abort_all': true", param="rid")
        n = serving.abort(body.rid, "aborted by /abort_request")
        return {"aborted": n}

    return app


async def _answer_or_busy(query: Awaitable[T], what: str) -> T:
    """The engine's answer to a query; a 503 `EngineBusyError` when it takes longer than STATS_TIMEOUT_S (the
    engine is in a long step)."""
    try:
        return await query
    except TimeoutError:
        raise EngineBusyError(f"the engine {what} within {STATS_TIMEOUT_S:.0f} s (a long step); retry") from None


def _auth_state(model: ModelInfo) -> str:
    """"on" / "off" in a PD mode (off: no cluster secret, unauthenticated control plane); "n/a" when colocated."""
    if model.disaggregation_mode == "null":
        return "n/a"
    return "on" if model.pd_auth is not None else "off"


async def _counted(ctx: ServerContext, handler: Any) -> Any:
    """Run a generation handler (refusals are counted by `RejectionCounterMiddleware`; a dead engine is logged)."""
    try:
        return await handler
    except DecodeServerError as exc:
        if isinstance(exc, EngineDeadError):
            logger.error("refused a request: %s", exc.message)
        raise
