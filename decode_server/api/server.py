"""Start and stop the whole service: engine process first, then the HTTP server; signals end both cleanly.

Shutdown paths:
- SIGINT/SIGTERM: the server stops taking requests (`/health` and new requests answer 503, so a load balancer
  or Kubernetes takes it out of rotation); requests in flight may finish for up to `--graceful-shutdown-timeout`
  seconds (default 0); those still running then end with a clear "server shutting down" error (a final SSE
  error frame for streams, 503 otherwise), uvicorn stops, the engine is asked to exit and is reaped (killed
  if it does not exit in time). Exit code 0. A second signal aborts what is left and forces uvicorn out.
- Engine process death: every waiting request gets 503 (`EngineDeadError`), new ones too, and after a
  short grace period (so those answers reach their clients) the server stops with exit code 1.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

import uvicorn

from decode_server.api.app import ServerContext, create_app
from decode_server.api.engine_client import EngineClient
from decode_server.api.metrics import ServerMetrics
from decode_server.api.request_log import RequestLog
from decode_server.api.serving import ModelInfo
from decode_server.api.tokenization import TokenizerPool
from decode_server.api.uvicorn_server import SignalHandlingServer
from decode_server.config import EngineConfig, ServerConfig
from decode_server.errors import EngineDeadError, ServerShuttingDownError
from decode_server.model.tokenizer import read_chat_template

logger = logging.getLogger("decode_server.server")

ENGINE_DEATH_GRACE_S = 1.0
GRACEFUL_SHUTDOWN_S = 5
DRAIN_POLL_S = 0.05


class _Uvicorn(SignalHandlingServer):
    """uvicorn, with our signal handling: drain (or abort) in-flight requests first, and no re-raise of the
    signal after `serve()` returns (uvicorn re-raises it, which would turn a clean stop into death by signal).

    `drain()` is awaited on the first signal: it returns once uvicorn may stop (requests finished or aborted)."""

    def __init__(self, config: uvicorn.Config, drain: Any, abort_all: Any) -> None:
        super().__init__(config)
        self._drain = drain
        self._abort_all = abort_all
        self._draining: asyncio.Task[None] | None = None

    def on_signal(self, sig: int) -> None:
        if self.should_exit or self._draining is not None:
            logger.warning("second %s: aborting what is left and forcing exit", signal.Signals(sig).name)
            self._abort_all()
            self.should_exit = self.force_exit = True
            return
        logger.info("%s received: shutting down", signal.Signals(sig).name)

        async def drain_then_exit() -> None:
            try:
                await self._drain()
            finally:
                self.should_exit = True

        self._draining = asyncio.get_running_loop().create_task(drain_then_exit())


def _memory_summary(info: dict[str, Any]) -> str:
    """Bytes and tokens of each KV pool (falls back to the raw pool sizes)."""
    sizes = info.get("memory") or {k: v for k, v in (info.get("pools") or {}).items() if v}
    return ", ".join(f"{k} {v}" for k, v in sizes.items()) or "n/a"


async def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Run until stopped; returns the process exit code (0 clean stop, 1 engine died or failed to start)."""
    state: dict[str, Any] = {"server": None}

    def on_engine_death() -> None:
        async def stop_later() -> None:
            await asyncio.sleep(ENGINE_DEATH_GRACE_S)
            if state["server"] is not None:
                state["server"].should_exit = True

        asyncio.get_running_loop().create_task(stop_later())

    client = EngineClient(engine_config, log_level=server_config.log_level, on_engine_death=on_engine_death,
                          heartbeat_timeout_s=server_config.engine_heartbeat_timeout)
    # The tokenizer module is light (no torch), but importing it still overlaps with the engine loading the model.
    tokenizer_import = asyncio.create_task(asyncio.to_thread(_import_tokenizer_class))
    try:
        info = await client.start()
        tokenizer_cls = await tokenizer_import
        # The engine resolved (and for tiny-dsa, generated) the checkpoint; read its tokenizer from there.
        model_dir = info["model_dir"]
        chat_template = read_chat_template(server_config.chat_template) if server_config.chat_template else None
        tokenizer = tokenizer_cls.from_dir(model_dir, chat_template=chat_template)
        tokenizer_pool = TokenizerPool(tokenizer, model_dir, chat_template=chat_template)
        await tokenizer_pool.start()
    except BaseException:
        tokenizer_import.cancel()
        await client.shutdown("start-up failed", timeout_s=5)
        raise
    served = server_config.served_model_name or engine_config.model_path
    pd_auth = _pd_auth(engine_config)
    context_length = int(info.get("context_length") or engine_config.context_length or 0)
    model = ModelInfo(
        served_model_name=served,
        context_length=context_length,
        max_request_tokens=int(info.get("max_request_tokens") or context_length),
        vocab_size=int(info.get("vocab_size") or tokenizer.vocab_size),
        accepted_names=frozenset({served, engine_config.model_path}),
        disaggregation_mode=engine_config.disaggregation.mode,
        pd_auth=pd_auth,
        prefix_caching=engine_config.enable_prefix_caching,
        reasoning_parser=server_config.reasoning_parser,
        tool_call_parser=server_config.tool_call_parser,
    )
    metrics = ServerMetrics(served)
    request_log = RequestLog(server_config.log_requests_level, tokenizer) if server_config.log_requests else None
    ctx = ServerContext(client, tokenizer, model, metrics, dict(info, model_path=model_dir),
                        server_config.api_key, tokenizer_pool, request_log)  # fmt: skip
    app = create_app(ctx)

    def abort_all() -> None:
        client.closing = True
        client.fail_all(ServerShuttingDownError("request aborted: server shutting down"))

    async def drain() -> None:
        """Refuse new work at once; give requests in flight up to the graceful timeout, then abort the rest."""
        client.closing = True
        deadline = asyncio.get_running_loop().time() + server_config.graceful_shutdown_timeout
        if client.num_inflight and server_config.graceful_shutdown_timeout > 0:
            logger.info("draining %d request(s) for up to %.0f s", client.num_inflight,
                        server_config.graceful_shutdown_timeout)  # fmt: skip
        while client.num_inflight and not client.dead and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if client.num_inflight:
            logger.info("aborting %d request(s) still in flight", client.num_inflight)
        abort_all()

    uv_config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.port,
        log_config=None,
        log_level=server_config.log_level,
        access_log=server_config.log_level == "debug",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        ssl_keyfile=server_config.ssl_keyfile,
        ssl_certfile=server_config.ssl_certfile,
        lifespan="off",
        # h11, as tested (uvicorn would pick httptools, a dependency of the PD router, when it is installed)
        http="h11",
    )
    server = _Uvicorn(uv_config, drain, abort_all)
    state["server"] = server
    logger.info(
        "model %s (%s), mode %s, device %s, context length %d, served as '%s'; memory: %s",
        engine_config.model_path, model_dir, info.get("mode"), info.get("device"), model.context_length,
        served, _memory_summary(info),
    )  # fmt: skip
    scheme = "https" if server_config.ssl_certfile else "http"
    logger.info("listening on %s://%s:%d (OpenAI API under /v1)", scheme, server_config.host, server_config.port)
    try:
        await server.serve()
    finally:
        engine_code = await client.shutdown()
        await asyncio.to_thread(tokenizer_pool.shutdown)
    if client.dead:
        logger.error("exiting because the engine process died (%s)", client.death_reason)
        return 1
    if not server.started:
        logger.error("the HTTP server failed to start (is port %d free?)", server_config.port)
        return 1
    logger.info("stopped (engine exit code %s)", engine_code)
    return 0


def _pd_auth(engine_config: EngineConfig) -> Any:
    """PD modes: the cluster secret's checks of the router's room tickets; without a secret, a loud warning (the
    engine process warns again for the control plane itself)."""
    from transfer.auth import PDAuth

    cfg = engine_config.disaggregation
    if not cfg.enabled:
        return None
    auth = PDAuth.from_file(cfg.auth_secret_file)
    if auth is None:
        logger.warning("!!! --disaggregation-mode %s WITHOUT --disaggregation-auth-secret-file: the PD control plane "
                       "is unauthenticated; anything that reaches this server can name rooms and steer KV "
                       "transfers. Fine for local development only (docs/pd.md) !!!", cfg.mode)
    return auth


def _import_tokenizer_class() -> Any:
    from decode_server.model import Tokenizer

    return Tokenizer


def run(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    try:
        return asyncio.run(serve(engine_config, server_config))
    except EngineDeadError as exc:
        logger.error("could not start: %s", exc.message)
        return 1
