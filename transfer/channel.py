"""ZMQ control channel: one PULL socket we bind (our `endpoint`) and cached PUSH sockets to peers' endpoints.

With a cluster secret (`auth`) every frame sent is sealed (transfer/auth.py) and every frame received must be
sealed with the same secret, addressed to this endpoint, fresh and not seen before; otherwise it is dropped with
one (rate-limited) log line and counted by reason through `on_reject`. The MAC is checked before the frame is
parsed. Frames larger than `max_message_bytes` and frames that do not decode are dropped and counted the same way
(also without a secret); ZMQ itself closes a connection that sends a frame over twice that size.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from transfer.auth import AuthRejected, PDAuth, RejectionLog, ReplayGuard
from transfer.messages import Message, ProtocolError, ProtocolVersionError, decode_envelope, encode

logger = logging.getLogger(__name__)

SEND_HWM = 10_000  # queued messages per peer before sends fail (a peer that never reads)
# A ROOM names 3 int32 row lists of the prompt's length: 16 MiB covers a 1M-token prompt.
MAX_CONTROL_MESSAGE_BYTES = 16 * 2**20


class ControlChannel:
    def __init__(self, host: str, auth: PDAuth | None = None, on_reject: Callable[[str], None] | None = None,
                 max_message_bytes: int = MAX_CONTROL_MESSAGE_BYTES) -> None:  # fmt: skip
        self.auth = auth
        self.max_message_bytes = max_message_bytes
        self._on_reject = on_reject
        self._guard = ReplayGuard(auth.window_s) if auth is not None else None
        self._log = RejectionLog("control message")
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, 2 * max_message_bytes)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._push: dict[str, zmq.Socket] = {}
        self._send_lock = threading.Lock()
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)

    def frame(self, endpoint: str, msg: Message) -> bytes:
        """The bytes `send` puts on the wire for `msg` to `endpoint` (sealed when we have a secret)."""
        if self.auth is None:
            return encode(msg, self.endpoint)
        return self.auth.seal(encode(msg, self.endpoint, envelope=PDAuth.envelope(endpoint)))

    def send(self, endpoint: str, msg: Message) -> bool:
        """Queue `msg` to `endpoint` without blocking; False (logged) if it cannot be queued."""
        data = self.frame(endpoint, msg)
        with self._send_lock:
            sock = self._push.get(endpoint)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, SEND_HWM)
                try:
                    sock.connect(endpoint)
                except zmq.ZMQError as exc:  # a peer's reply_to that is no endpoint at all
                    sock.close(0)
                    logger.warning("control message %s not sent: cannot connect to %r: %s", type(msg).__name__,
                                   endpoint[:200], exc)
                    return False
                self._push[endpoint] = sock
            try:
                sock.send(data, zmq.NOBLOCK)
                return True
            except zmq.ZMQError as exc:
                logger.warning("control message %s to %s not sent: %s", type(msg).__name__, endpoint, exc)
                return False

    def forget(self, endpoint: str) -> None:
        """Drop the cached socket to a peer (dead or restarted: its queued messages are discarded)."""
        with self._send_lock:
            sock = self._push.pop(endpoint, None)
            if sock is not None:
                sock.close(0)

    def reject(self, reason: str, detail: str, source: str = "") -> None:
        """Count and log one refused message (also used by the sender/receiver for peer-binding refusals)."""
        self._log(reason, detail, source)
        if self._on_reject is not None:
            self._on_reject(reason)

    def _accept(self, data: bytes) -> tuple[Message, str] | ProtocolError | None:
        if len(data) > self.max_message_bytes:
            self.reject("oversize", f"control frame of {len(data)} bytes (at most {self.max_message_bytes})")
            return None
        try:
            if self.auth is not None:
                data = self.auth.open(data)
            msg, reply_to, envelope = decode_envelope(data)
            if self._guard is not None:
                if envelope.get("to") != self.endpoint:
                    raise AuthRejected("wrong_destination", f"frame addressed to {envelope.get('to')!r}, not us")
                self._guard.check(envelope.get("ts"), envelope.get("nonce"))
            return msg, reply_to
        except AuthRejected as exc:
            self.reject(exc.reason, exc.detail)
        except ProtocolVersionError as exc:
            if self._on_reject is not None:
                self._on_reject("version")
            return exc  # answered by the consumer (a REGISTER gets a refusal naming both versions)
        except ProtocolError as exc:
            self.reject("malformed", str(exc))
        return None

    def receive(self, timeout_ms: int) -> list[tuple[Message, str] | ProtocolError]:
        """Messages that arrive within `timeout_ms` (all that are queued once one is): (message, reply_to), or
        the ProtocolVersionError of an authentic message of another protocol version. Everything else that
        cannot be accepted is dropped here (logged and counted)."""
        out: list[tuple[Message, str] | ProtocolError] = []
        if not self._poller.poll(timeout_ms):
            return out
        while True:
            try:
                data = self._pull.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return out
            item = self._accept(data)
            if item is not None:
                out.append(item)

    def close(self) -> None:
        with self._send_lock:
            for sock in self._push.values():
                sock.close(0)
            self._push.clear()
        self._pull.close(0)
        self._ctx.term()
