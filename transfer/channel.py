"""ZMQ control channel: one PULL socket we bind (our `endpoint`) and cached PUSH sockets to peers' endpoints."""

from __future__ import annotations

import logging
import threading

import zmq

from transfer.messages import Message, ProtocolError, decode, encode

logger = logging.getLogger(__name__)

SEND_HWM = 10_000  # queued messages per peer before sends fail (a peer that never reads)


class ControlChannel:
    def __init__(self, host: str) -> None:
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._push: dict[str, zmq.Socket] = {}
        self._send_lock = threading.Lock()
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)

    def send(self, endpoint: str, msg: Message) -> bool:
        """Queue `msg` to `endpoint` without blocking; False (logged) if it cannot be queued."""
        data = encode(msg, self.endpoint)
        with self._send_lock:
            sock = self._push.get(endpoint)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, SEND_HWM)
                sock.connect(endpoint)
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

    def receive(self, timeout_ms: int) -> list[tuple[Message, str] | ProtocolError]:
        """Messages that arrive within `timeout_ms` (all that are queued once one is): (message, reply_to), or
        the ProtocolError of a message that could not be accepted."""
        out: list[tuple[Message, str] | ProtocolError] = []
        if not self._poller.poll(timeout_ms):
            return out
        while True:
            try:
                data = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(decode(data))
            except ProtocolError as exc:
                out.append(exc)

    def close(self) -> None:
        with self._send_lock:
            for sock in self._push.values():
                sock.close(0)
            self._push.clear()
        self._pull.close(0)
        self._ctx.term()
