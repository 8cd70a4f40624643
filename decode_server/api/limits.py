"""Limits at the HTTP edge, applied before a handler runs, plus the counting of every refusal a client sees.

- `BodyLimitMiddleware`: a request body over `MAX_BODY_BYTES` is refused with 413 (by its Content-Length, or
  while it streams in), so a client cannot make the api process buffer and parse an unbounded body.
- `RejectionCounterMiddleware`: every response with status >= 400 (validation errors, auth, unknown routes,
  refusals, disconnects, internal errors) increments `sglang:num_rejected_requests_total{status, reason}`, reason
  being the OpenAI error `type` of the body. Probes (`/health`, `/health_generate`) are not counted: a
  liveness probe polling a dead engine is not a client being refused; nor is 499 (the client disconnected and
  sees no answer).
Both are plain ASGI middlewares (Starlette's `BaseHTTPMiddleware` would buffer streams and hide disconnects).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from decode_server.api.errors import error_body
from decode_server.api.metrics import ServerMetrics

MAX_BODY_BYTES = 32 << 20  # 32 MiB: a 1 MB prompt many times over, far below what would strain the api process
UNCOUNTED_PATHS = frozenset({"/health", "/health_generate"})
CLIENT_CLOSED = 499


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send)
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(error_body(f"request body is larger than {self.max_bytes} bytes",
                                     "invalid_request_error", 413)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class RejectionCounterMiddleware:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNCOUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        status = 0
        body = bytearray()

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and status >= 400 and status != CLIENT_CLOSED:
                body.extend(message.get("body", b"")[: 64 << 10])
                if not message.get("more_body", False):
                    self.metrics.on_rejected(status, _error_type(bytes(body)))
            await send(message)

        await self.app(scope, receive, counting_send)


def _error_type(body: bytes) -> str:
    try:
        parsed: Any = json.loads(body)
        return str(parsed["error"]["type"])
    except (ValueError, KeyError, TypeError):
        return "unknown"
