"""The bootstrap rendezvous: a small HTTP server inside the prefill server, and its client.

Prefill ranks register how to reach them (`PUT /route`: ZMQ endpoint, transfer session id, layout); decode looks
them up (`GET /route?rank=N`) before its first room with that prefill, and heartbeats `GET /health`. Both routes
answer 503 until a prefill rank has registered. The server binds only the host it is given (use the address
decode reaches prefill on, not 0.0.0.0, unless every interface is meant).
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

logger = logging.getLogger(__name__)


class BootstrapUnavailable(RuntimeError):
    """The bootstrap server could not be reached or has no such rank yet (the reason says which)."""


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        logger.debug("bootstrap %s: " + format, self.client_address[0], *args)

    def _reply(self, status: HTTPStatus, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _rank(self) -> int | None:
        query = parse_qs(urlsplit(self.path).query)
        try:
            return int(query.get("rank", ["0"])[0])
        except ValueError:
            self._reply(HTTPStatus.BAD_REQUEST, {"error": "rank must be an integer"})
            return None

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path = urlsplit(self.path).path
        routes = self.server.routes
        if path == "/health":
            if routes:
                self._reply(HTTPStatus.OK, {"status": "ok"})
            else:
                self._reply(HTTPStatus.SERVICE_UNAVAILABLE, {"error": "no prefill rank registered yet"})
        elif path == "/route":
            rank = self._rank()
            if rank is None:
                return
            with self.server.lock:
                info = routes.get(rank)
            if not routes:
                self._reply(HTTPStatus.SERVICE_UNAVAILABLE, {"error": "no prefill rank registered yet"})
            elif info is None:
                self._reply(HTTPStatus.NOT_FOUND, {"error": f"no prefill rank {rank} (have {sorted(routes)})"})
            else:
                self._reply(HTTPStatus.OK, info)
        else:
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"unknown path {path}"})

    def do_PUT(self) -> None:  # noqa: N802
        if urlsplit(self.path).path != "/route":
            self._reply(HTTPStatus.NOT_FOUND, {"error": "unknown path"})
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
            info = json.loads(self.rfile.read(length))
            rank = int(info.get("rank", 0))
            for key in ("zmq_endpoint", "session_id", "layout"):
                if key not in info:
                    raise ValueError(f"missing field {key!r}")
        except (ValueError, TypeError, AttributeError) as exc:
            self._reply(HTTPStatus.BAD_REQUEST, {"error": f"bad registration: {exc}"})
            return
        with self.server.lock:
            self.server.routes[rank] = info
        logger.info("bootstrap: prefill rank %d registered (%s, session %s)", rank, info["zmq_endpoint"],
                    info["session_id"])
        self._reply(HTTPStatus.OK, {"ok": True})

    def do_DELETE(self) -> None:  # noqa: N802
        if urlsplit(self.path).path != "/route":
            self._reply(HTTPStatus.NOT_FOUND, {"error": "unknown path"})
            return
        rank = self._rank()
        if rank is None:
            return
        with self.server.lock:
            self.server.routes.pop(rank, None)
        self._reply(HTTPStatus.OK, {"ok": True})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int]) -> None:
        super().__init__(address, _Handler)
        self.routes: dict[int, dict[str, Any]] = {}
        self.lock = threading.Lock()


class BootstrapServer:
    """HTTP bootstrap server on (host, port) in a background thread; port 0 picks a free port (see `.port`)."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self._server = _Server((host, port))
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"bootstrap-{self.port}", daemon=True)
        self._thread.start()
        logger.info("bootstrap server listening on http://%s:%d", host, self.port)

    @property
    def bound_address(self) -> tuple[str, int]:
        return tuple(self._server.socket.getsockname()[:2])

    @property
    def routes(self) -> dict[int, dict[str, Any]]:
        with self._server.lock:
            return dict(self._server.routes)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


class BootstrapClient:
    """Talks to one bootstrap server. Ignores HTTP proxy settings (the peers are on the cluster network)."""

    def __init__(self, host: str, port: int, timeout_s: float = 2.0) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.base = f"http://{host}:{port}"
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _call(self, method: str, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with self._opener.open(req, timeout=timeout_s or self.timeout_s) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            try:
                detail = json.loads(exc.read()).get("error", "")
            except (ValueError, AttributeError):
                detail = ""
            raise BootstrapUnavailable(f"bootstrap server {self.base} answered {exc.code} to {method} {path}"
                                       + (f": {detail}" if detail else "")) from exc
        except (OSError, ValueError) as exc:  # URLError, connection refused, timeout, bad JSON
            reason = getattr(exc, "reason", exc)
            raise BootstrapUnavailable(f"bootstrap server {self.base} unreachable: {reason}") from exc

    def register(self, info: dict[str, Any]) -> None:
        self._call("PUT", "/route", info)

    def unregister(self, rank: int = 0) -> None:
        self._call("DELETE", f"/route?rank={rank}")

    def lookup(self, rank: int = 0) -> dict[str, Any]:
        return self._call("GET", f"/route?rank={rank}")

    def health(self, timeout_s: float | None = None) -> None:
        """Returns if healthy; raises BootstrapUnavailable with the reason otherwise."""
        self._call("GET", "/health", timeout_s=timeout_s)
