"""Authentication of the PD control plane with a cluster secret (HMAC-SHA256, stdlib `hmac` and `secrets`).

Who holds the secret: every prefill and decode server and the router of one deployment
(`--disaggregation-auth-secret-file`). What it protects (docs/pd.md, "Authentication and threat model"):

- ZMQ control frames (REGISTER, ROOM, STATUS, ABORT, ...): `b"HPA1" + mac + payload`, the MAC over the msgpack
  payload, which carries a timestamp, a 16-byte random nonce and the destination endpoint (`to`). The receiver
  checks the MAC before it parses anything, then that the frame was meant for it, that the timestamp is within
  `window_s` of its clock (else "stale") and that the nonce was not seen within the window (else "replay").
- Bootstrap HTTP requests (`PUT/GET/DELETE /route`): header `X-PD-Auth: <ts>:<nonce>:<mac>` over method, path,
  timestamp, nonce and a hash of the body; the server's answer carries `X-PD-Auth-Reply`, a MAC over the client's
  nonce, the status and the body, so decode also knows it is talking to a prefill server of its own deployment.
- Room tickets (`bootstrap_auth` in a request body): the router's MAC over the bootstrap fields it issued, so a
  server only accepts PD requests (and the rooms they name) that an authenticated router sent.

Each use has its own key derived from the secret (HMAC of a label), so a MAC of one kind can never pass as
another. Without a secret (`PDAuth` is None) nothing is signed or checked, as before.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import json
import logging
import os
import secrets
import stat
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SECRET_FILE_ENV = "HISPARSE_DISAGGREGATION_AUTH_SECRET_FILE"
MIN_SECRET_BYTES = 32
MAX_SECRET_BYTES = 4096
DEFAULT_WINDOW_S = 60.0  # accepted clock difference between peers; nonces are remembered this long
NONCE_BYTES = 16
MAC_BYTES = 32
FRAME_MAGIC = b"HPA1"
AUTH_HEADER = "X-PD-Auth"
REPLY_HEADER = "X-PD-Auth-Reply"
TICKET_VERSION = "v1"


class SecretError(ValueError):
    """The secret file cannot be used (missing, unreadable, too short); the message says which and why."""


class AuthRejected(Exception):
    """A frame, request or ticket failed authentication. `reason` is the metric label (a short fixed word)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """The secret in `path`, without surrounding whitespace (a trailing newline from `echo` or `openssl rand -hex`
    does not count). At least MIN_SECRET_BYTES bytes: `openssl rand -hex 32 > FILE` or `decode-server up`'s."""
    p = Path(path)
    try:
        data = p.read_bytes()[: MAX_SECRET_BYTES + 64].strip()
    except OSError as exc:
        raise SecretError(f"cannot read the disaggregation auth secret file {str(p)!r}: {exc.strerror or exc}") from exc
    if len(data) < MIN_SECRET_BYTES:
        raise SecretError(f"the disaggregation auth secret in {str(p)!r} has {len(data)} bytes; at least "
                          f"{MIN_SECRET_BYTES} are needed (e.g. `openssl rand -hex 32 > {p.name}`)")
    if len(data) > MAX_SECRET_BYTES:
        raise SecretError(f"the disaggregation auth secret file {str(p)!r} is larger than {MAX_SECRET_BYTES} bytes")
    try:
        mode = p.stat().st_mode
        if mode & (stat.S_IROTH | stat.S_IWOTH):
            logger.warning("the disaggregation auth secret file %s is readable by other users (mode %o): chmod 600",
                           p, stat.S_IMODE(mode))
    except OSError:
        pass
    return data


def _derive(secret: bytes, label: str) -> bytes:
    return hmac.new(secret, b"hisparse-pd/" + label.encode(), hashlib.sha256).digest()


class ReplayGuard:
    """Rejects a (timestamp, nonce) outside the window or seen before within it. Thread-safe.

    A nonce is remembered until its timestamp leaves the window (`ts + window_s`): after that the timestamp check
    alone refuses it, so memory is bounded by the rate of authenticated messages times the window."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S) -> None:
        self.window_s = window_s
        self._seen: set[bytes] = set()
        self._expiry: list[tuple[float, bytes]] = []
        self._lock = threading.Lock()

    def check(self, ts: Any, nonce: Any, now: float | None = None) -> None:
        if not isinstance(ts, int | float) or isinstance(ts, bool) or not isinstance(nonce, bytes) \
                or len(nonce) != NONCE_BYTES:  # fmt: skip
            raise AuthRejected("malformed", "authenticated envelope without a valid timestamp and nonce")
        now = time.time() if now is None else now
        if abs(now - ts) > self.window_s:
            raise AuthRejected("stale", f"timestamp {now - ts:+.1f} s from ours (window ±{self.window_s:g} s)")
        with self._lock:
            while self._expiry and self._expiry[0][0] < now:
                self._seen.discard(heapq.heappop(self._expiry)[1])
            if nonce in self._seen:
                raise AuthRejected("replay", "nonce already seen within the window (a replayed message)")
            self._seen.add(nonce)
            heapq.heappush(self._expiry, (float(ts) + self.window_s, nonce))

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)


class PDAuth:
    """The keys derived from one cluster secret, and the signing and checking of each protected message."""

    def __init__(self, secret: bytes, window_s: float = DEFAULT_WINDOW_S) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise SecretError(f"a disaggregation auth secret needs at least {MIN_SECRET_BYTES} bytes")
        self.window_s = window_s
        self._control = _derive(secret, "control/v1")
        self._bootstrap = _derive(secret, "bootstrap/v1")
        self._ticket = _derive(secret, "room-ticket/v1")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str] | None, window_s: float = DEFAULT_WINDOW_S) -> PDAuth | None:
        return None if not path else cls(load_secret(path), window_s)

    # ---- ZMQ control frames ---------------------------------------------------------------------------------------

    @staticmethod
    def envelope(to: str) -> dict[str, Any]:
        """The fields an authenticated payload carries besides the message: when, a fresh nonce, and for whom."""
        return {"ts": time.time(), "nonce": secrets.token_bytes(NONCE_BYTES), "to": to}

    def seal(self, payload: bytes) -> bytes:
        return FRAME_MAGIC + hmac.new(self._control, payload, hashlib.sha256).digest() + payload

    def open(self, frame: bytes) -> bytes:
        """The payload of a sealed frame; AuthRejected if it is not one or its MAC is wrong. Runs before any parsing."""
        head = len(FRAME_MAGIC) + MAC_BYTES
        if len(frame) < head or not frame.startswith(FRAME_MAGIC):
            raise AuthRejected("unauthenticated", f"control frame of {len(frame)} bytes without authentication")
        payload = frame[head:]
        mac = hmac.new(self._control, payload, hashlib.sha256).digest()
        if not hmac.compare_digest(mac, frame[len(FRAME_MAGIC):head]):
            raise AuthRejected("bad_mac", "control frame with a wrong MAC (another secret, or altered)")
        return payload

    # ---- bootstrap HTTP -------------------------------------------------------------------------------------------

    def _request_mac(self, method: str, target: str, ts: str, nonce: str, body: bytes) -> str:
        data = "\n".join((method.upper(), target, ts, nonce, hashlib.sha256(body).hexdigest())).encode()
        return hmac.new(self._bootstrap, b"request\n" + data, hashlib.sha256).hexdigest()

    def sign_request(self, method: str, target: str, body: bytes = b"") -> tuple[str, str]:
        """(header value, nonce) for a bootstrap request to `target` (path and query)."""
        ts, nonce = f"{time.time():.6f}", secrets.token_hex(NONCE_BYTES)
        return f"{ts}:{nonce}:{self._request_mac(method, target, ts, nonce, body)}", nonce

    def verify_request(self, header: str | None, method: str, target: str, body: bytes, guard: ReplayGuard) -> str:
        """The client's nonce of an authentic, fresh request; AuthRejected otherwise."""
        if not header:
            raise AuthRejected("unauthenticated", f"{method} {target} without the {AUTH_HEADER} header")
        parts = header.split(":")
        if len(parts) != 3:
            raise AuthRejected("malformed", f"malformed {AUTH_HEADER} header")
        ts, nonce, mac = parts
        if not hmac.compare_digest(self._request_mac(method, target, ts, nonce, body).encode(), mac.encode()):
            raise AuthRejected("bad_mac", f"{method} {target} with a wrong MAC (another secret, or altered)")
        try:
            guard.check(float(ts), bytes.fromhex(nonce))
        except ValueError:
            raise AuthRejected("malformed", f"malformed {AUTH_HEADER} header") from None
        return nonce

    def _reply_mac(self, nonce: str, status: int, body: bytes) -> str:
        data = f"reply\n{nonce}\n{status}\n{hashlib.sha256(body).hexdigest()}".encode()
        return hmac.new(self._bootstrap, data, hashlib.sha256).hexdigest()

    def sign_reply(self, nonce: str, status: int, body: bytes) -> str:
        return self._reply_mac(nonce, status, body)

    def verify_reply(self, header: str | None, nonce: str, status: int, body: bytes) -> None:
        if not header or not hmac.compare_digest(self._reply_mac(nonce, status, body).encode(), header.encode()):
            raise AuthRejected("bad_reply", "the bootstrap server's answer is not authenticated with our secret")

    # ---- room tickets (router -> servers) -------------------------------------------------------------------------

    def _ticket_mac(self, host: Any, port: Any, room: Any, ts_ms: int) -> str:
        data = json.dumps([host, port, room, ts_ms], separators=(",", ":")).encode()
        return hmac.new(self._ticket, data, hashlib.sha256).hexdigest()

    def sign_ticket(self, host: Any, port: Any, room: Any) -> str:
        """`bootstrap_auth` for a request body with these `bootstrap_host`, `bootstrap_port`, `bootstrap_room`
        values (scalars or per-prompt lists, exactly as they go in the body)."""
        ts_ms = int(time.time() * 1000)
        return f"{TICKET_VERSION}:{ts_ms}:{self._ticket_mac(host, port, room, ts_ms)}"

    def verify_ticket(self, ticket: Any, host: Any, port: Any, room: Any) -> None:
        if not ticket:
            raise AuthRejected("no_ticket", "the request carries no 'bootstrap_auth' (it was not sent by an "
                               "authenticated PD router)")
        parts = ticket.split(":") if isinstance(ticket, str) else []
        if len(parts) != 3 or parts[0] != TICKET_VERSION or not parts[1].isdigit():
            raise AuthRejected("malformed", "malformed 'bootstrap_auth'")
        ts_ms = int(parts[1])
        if not hmac.compare_digest(self._ticket_mac(host, port, room, ts_ms).encode(), parts[2].encode()):
            raise AuthRejected("bad_mac", "'bootstrap_auth' does not match the bootstrap fields (another secret, "
                               "or the fields were changed)")
        age = time.time() - ts_ms / 1000
        if abs(age) > self.window_s:
            raise AuthRejected("stale", f"'bootstrap_auth' issued {age:+.1f} s ago (window ±{self.window_s:g} s)")


class RejectionLog:
    """One warning line per rejection, at most `burst` lines per `period_s` (a flood of garbage must not flood the
    log too); the number left out is told in the next line that is written. Counters are kept separately."""

    def __init__(self, what: str, burst: int = 20, period_s: float = 10.0) -> None:
        self.what, self.burst, self.period_s = what, burst, period_s
        self._window_start = 0.0
        self._written = 0
        self._suppressed = 0
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def __call__(self, reason: str, detail: str, source: str = "") -> None:
        now = time.monotonic()
        with self._lock:
            self.counts[reason] += 1
            if now - self._window_start > self.period_s:
                self._window_start, self._written = now, 0
            if self._written >= self.burst:
                self._suppressed += 1
                return
            self._written += 1
            suppressed, self._suppressed = self._suppressed, 0
        logger.warning("rejected %s%s (%s): %s%s", self.what, f" from {source}" if source else "", reason, detail,
                       f" [{suppressed} similar lines suppressed]" if suppressed else "")
