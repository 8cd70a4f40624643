"""`--api-key`: every route except the probes and the scrape target needs `Authorization: Bearer <key>`.

A plain ASGI middleware (not Starlette's `BaseHTTPMiddleware`, which buffers streaming responses and hides
client disconnects from the handlers). The key is compared in constant time.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

from decode_server.api.errors import error_body

# Liveness/readiness probes and Prometheus scrapers usually carry no credentials.
# /load is what a router's least_load policy polls: the same numbers /metrics shows.
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics", "/load"})


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = _bearer(headers.get(b"authorization", b"")) or headers.get(b"x-api-key", b"")
        if given and hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        message = "invalid API key" if given else "missing API key: send 'Authorization: Bearer <key>'"
        body = json.dumps(error_body(message, "authentication_error", 401)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _bearer(value: bytes) -> bytes:
    scheme, _, token = value.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""
