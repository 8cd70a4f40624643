"""Versioned control messages between a decode receiver and a prefill sender (ZMQ PUSH -> PULL, msgpack).

Every message is one frame: a msgpack map with the envelope `v` (PROTOCOL_VERSION), `type` and `reply_to` (the
sender's own PULL endpoint, so the peer can answer without a lookup), plus the fields of its type. A message of
another protocol version is refused with a `ProtocolVersionError` that names both versions.

Sequence (D = decode receiver, P = prefill sender):
  D -> P  REGISTER        once per peer: D's session id, its regions and aux region, its layout
  P -> D  REGISTER_REPLY  ok, or refused with the reason (layout mismatch)
  D -> P  ROOM            per request: room, destination rows per region (int32 bytes), aux index, token count
  P -> D  STATUS          room SUCCESS (every row and the aux record are written) or FAILED with the reason
  D -> P  ABORT           decode gave the room up (client abort, waiting timeout); P stops writing and ...
  P -> D  ABORT_ACK       ... acknowledges once nothing is in flight for the room (D may then reuse its pages)
  P -> D  ABORT           prefill gave the room up (e.g. its request failed); D fails the room and ...
  D -> P  ABORT_ACK       ... acknowledges
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

import msgpack
import numpy as np

from transfer.layout import PROTOCOL_VERSION

ALL_REGIONS = "*"  # dst_rows key: the same rows for every region


class MsgType(StrEnum):
    REGISTER = "register"
    REGISTER_REPLY = "register_reply"
    ROOM = "room"
    STATUS = "status"
    ABORT = "abort"
    ABORT_ACK = "abort_ack"


class ProtocolError(ValueError):
    """A control message that cannot be decoded."""


class ProtocolVersionError(ProtocolError):
    def __init__(self, msg_type: str, reply_to: str, version: Any) -> None:
        self.msg_type, self.reply_to, self.version = msg_type, reply_to, version
        super().__init__(f"control message {msg_type!r} from {reply_to or 'unknown peer'} has protocol version "
                         f"{version!r}, ours is {PROTOCOL_VERSION}: refused (upgrade both sides together)")


@dataclass
class Register:
    receiver_id: str  # decode's transfer session id ("host:rpc_port"), the target of prefill's writes
    layout: dict[str, Any]
    regions: dict[str, dict[str, int]]  # name -> MemoryRegion.describe()
    aux: dict[str, int]  # the aux region's description


@dataclass
class RegisterReply:
    receiver_id: str
    ok: bool
    reason: str = ""
    sender_id: str = ""


@dataclass
class RoomRequest:
    room: int
    receiver_id: str
    num_tokens: int
    aux_index: int
    dst_rows: dict[str, bytes] = field(default_factory=dict)  # region name (or ALL_REGIONS) -> int32 row bytes

    @staticmethod
    def pack_rows(rows: Sequence[int] | Mapping[str, Sequence[int]]) -> dict[str, bytes]:
        if isinstance(rows, Mapping):
            return {str(k): np.asarray(v, dtype=np.int32).tobytes() for k, v in rows.items()}
        return {ALL_REGIONS: np.asarray(rows, dtype=np.int32).tobytes()}

    def rows_for(self, region: str) -> np.ndarray:
        data = self.dst_rows.get(region, self.dst_rows.get(ALL_REGIONS))
        if data is None:
            raise KeyError(f"room {self.room}: no destination rows for region {region!r}")
        return np.frombuffer(data, dtype=np.int32)


@dataclass
class Status:
    room: int
    ok: bool
    reason: str = ""


@dataclass
class Abort:
    room: int
    reason: str
    receiver_id: str = ""


@dataclass
class AbortAck:
    room: int


_TYPES: dict[MsgType, type] = {MsgType.REGISTER: Register, MsgType.REGISTER_REPLY: RegisterReply,
                               MsgType.ROOM: RoomRequest, MsgType.STATUS: Status, MsgType.ABORT: Abort,
                               MsgType.ABORT_ACK: AbortAck}
_NAMES = {cls: t for t, cls in _TYPES.items()}

Message = Register | RegisterReply | RoomRequest | Status | Abort | AbortAck


def encode(msg: Message, reply_to: str, version: int = PROTOCOL_VERSION) -> bytes:
    body = asdict(msg)
    body.update(v=version, type=_NAMES[type(msg)].value, reply_to=reply_to)
    return msgpack.packb(body, use_bin_type=True)


def decode(data: bytes) -> tuple[Message, str]:
    """(message, reply_to). Raises ProtocolVersionError for another version, ProtocolError for garbage."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"undecodable control message ({len(data)} bytes): {exc}") from exc
    if not isinstance(body, dict):
        raise ProtocolError(f"control message is a {type(body).__name__}, not a map")
    msg_type, reply_to, version = body.pop("type", None), body.pop("reply_to", ""), body.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolVersionError(str(msg_type), str(reply_to), version)
    try:
        cls = _TYPES[MsgType(msg_type)]
        return cls(**body), str(reply_to)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"malformed control message of type {msg_type!r}: {exc}") from exc
