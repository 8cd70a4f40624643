"""The bootstrap rendezvous: a small HTTP server inside the prefill server, and its client.

Prefill ranks register how to reach them (`PUT /route`: ZMQ endpoint, transfer session id, layout); decode looks
them up (`GET /route?rank=N`) before its first room with that prefill, and heartbeats `GET /health`. Both routes
answer 503 until a prefill rank has registered. The server binds only the host it is given (use the address
decode reaches prefill on, not 0.0.0.0, unless every interface is meant).

With a cluster secret (`auth`), every `/route` request must carry a valid, fresh `X-PD-Auth` header (else 401,
one log line, a counter by reason) and every answer to one carries `X-PD-Auth-Reply`, which the client checks:
both sides then know the other holds the secret. `/health` stays open (it says only whether a rank registered).
A client whose request is refused with 401, or whose answer is not authenticated, raises `BootstrapAuthError`:
the secrets differ (or one side has none), which retrying cannot fix.
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

from transfer.auth import AUTH_HEADER, REPLY_HEADER, AuthRejected, PDAuth, RejectionLog, ReplayGuard

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20  # a registration is a few hundred bytes


class BootstrapUnavailable(RuntimeError):
    """The bootstrap server could not be reached or has no such rank yet (the reason says which)."""


class BootstrapAuthError(BootstrapUnavailable):
    """Authentication between the bootstrap server and its client failed: different secrets, or one has none."""


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's signature
        logger.debug("bootstrap %s: " + format, self.client_address[0], *args)

    _nonce: str | None = None  # the client's nonce of the authenticated request being answered

    def _reply(self, status: HTTPStatus, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        auth = self.server.auth
        if auth is not None and self._nonce is not None:
            self.send_header(REPLY_HEADER, auth.sign_reply(self._nonce, int(status), data))
        self.end_headers()
        self.wfile.write(data)

    def _authenticate(self, body: bytes = b"") -> bool:
        """With a secret: True for an authentic, fresh request (its answer will be signed); otherwise 401."""
        auth = self.server.auth
        self._nonce = None
        if auth is None:
            return True
        try:
            self._nonce = auth.verify_request(self.headers.get(AUTH_HEADER), self.command, self.path, body,
                                              self.server.guard)
            return True
        except AuthRejected as exc:
            self.server.reject(exc.reason, exc.detail, self.client_address[0])
            self.close_connection = True
            self._reply(HTTPStatus.UNAUTHORIZED, {"error": f"authentication failed ({exc.reason}): this bootstrap "
                                                  "server needs requests signed with the deployment's "
                                                  "disaggregation auth secret"})
            return False

    def _read_body(self) -> bytes | None:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY_BYTES:
            self.server.reject("oversize" if length > 0 else "malformed", f"request body of {length} bytes",
                               self.client_address[0])
            self.close_connection = True
            self._reply(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": f"body over {MAX_BODY_BYTES} bytes"})
            return None
        return self.rfile.read(length)

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
            if not self._authenticate():
                return
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
        raw = self._read_body()
        if raw is None or not self._authenticate(raw):
            return
        try:
            info = json.loads(raw)
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
        if not self._authenticate():
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

    def __init__(self, address: tuple[str, int], auth: PDAuth | None) -> None:
        super().__init__(address, _Handler)
        self.routes: dict[int, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.auth = auth
        self.guard = ReplayGuard(auth.window_s) if auth is not None else None
        self.rejections = RejectionLog("bootstrap request")

    def reject(self, reason: str, detail: str, source: str) -> None:
        self.rejections(reason, detail, source)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that broke mid-request (or sent garbage the handler choked on): one line, no traceback."""
        self.reject("malformed", "the connection failed while its request was handled", str(client_address[0]))


class BootstrapServer:
    """HTTP bootstrap server on (host, port) in a background thread; port 0 picks a free port (see `.port`).

    `rejected`: the requests refused (authentication, oversize, malformed), by reason."""

    def __init__(self, host: str, port: int, auth: PDAuth | None = None) -> None:
        self.host = host
        self._server = _Server((host, port), auth)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"bootstrap-{self.port}", daemon=True)
        self._thread.start()
        logger.info("bootstrap server listening on http://%s:%d", host, self.port)

    @property
    def bound_address(self) -> tuple[str, int]:
        return tuple(self._server.socket.getsockname()[:2])

    @property
    def rejected(self) -> dict[str, int]:
        return self._server.rejections.snapshot()

    @property
    def routes(self) -> dict[int, dict[str, Any]]:
        with self._server.lock:
            return dict(self._server.routes)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


class BootstrapClient:
    """Talks to one bootstrap server. Ignores HTTP proxy settings (the peers are on the cluster network).
    With `auth`, signs its `/route` requests and accepts only answers signed with the same secret."""

    def __init__(self, host: str, port: int, timeout_s: float = 2.0, auth: PDAuth | None = None) -> None:
        self.host, self.port, self.timeout_s, self.auth = host, port, timeout_s, auth
        self.base = f"http://{host}:{port}"
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _call(self, method: str, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        nonce = None
        if self.auth is not None and path.startswith("/route"):
            headers[AUTH_HEADER], nonce = self.auth.sign_request(method, path, data or b"")
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=headers)
        try:
            with self._opener.open(req, timeout=timeout_s or self.timeout_s) as resp:
                raw = resp.read()
                if nonce is not None:
                    try:
                        self.auth.verify_reply(resp.headers.get(REPLY_HEADER), nonce, resp.status, raw)  # type: ignore[union-attr]
                    except AuthRejected as exc:
                        raise BootstrapAuthError(
                            f"bootstrap server {self.base} did not authenticate its answer to {method} {path} "
                            "(it runs without --disaggregation-auth-secret-file, or with another secret)") from exc
                return json.loads(raw or b"null")
        except urllib.error.HTTPError as exc:
            try:
                detail = json.loads(exc.read()).get("error", "")
            except (ValueError, AttributeError):
                detail = ""
            if exc.code == HTTPStatus.UNAUTHORIZED:
                ours = "ours has another secret" if self.auth is not None else "this server has no secret"
                raise BootstrapAuthError(
                    f"bootstrap server {self.base} refused our authentication (401 to {method} {path}: {detail}); "
                    f"the servers' --disaggregation-auth-secret-file secrets must match ({ours})") from exc
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
