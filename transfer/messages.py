"""Versioned control messages between a decode receiver and a prefill sender (ZMQ PUSH -> PULL, msgpack).

Every message is one frame: a msgpack map with the envelope `v` (PROTOCOL_VERSION), `type` and `reply_to` (the
sender's own PULL endpoint, so the peer can answer without a lookup), plus the fields of its type. A message of
another protocol version is refused with a `ProtocolVersionError` that names both versions. Rooms travel as 16
big-endian bytes (they are 128-bit; msgpack integers stop at 64). With a cluster secret the map also carries `ts`,
`nonce` and `to`, and the frame is sealed with a MAC (transfer/auth.py); `decode_envelope` returns those fields.
Field types are checked here, so a consumer never sees e.g. a list where a room belongs.

Sequence (D = decode receiver, P = prefill sender):
  D -> P  REGISTER        once per peer: D's session id, its regions and aux region, its layout
  P -> D  REGISTER_REPLY  ok, or refused with the reason (layout mismatch)
  D -> P  ROOM            per request: room, destination rows per region (int32 bytes), aux index, token count
  P -> D  STATUS          room SUCCESS (every row and the aux record are written; with the digest of the
                          destination it wrote, which decode compares with the one it registered) or FAILED
  D -> P  ABORT           decode gave the room up (client abort, waiting timeout); P stops writing and ...
  P -> D  ABORT_ACK       ... acknowledges once nothing is in flight for the room (D may then reuse its pages)
  P -> D  ABORT           prefill gave the room up (e.g. its request failed); D fails the room and ...
  D -> P  ABORT_ACK       ... acknowledges
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any

import msgpack
import numpy as np

from transfer.layout import PROTOCOL_VERSION

ALL_REGIONS = "*"  # dst_rows key: the same rows for every region
ROOM_BYTES = 16  # rooms are 128-bit (the router draws them with `secrets`)
MAX_ROOM = 2 ** (8 * ROOM_BYTES) - 1
ENVELOPE_FIELDS = ("ts", "nonce", "to")  # present in authenticated payloads only


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
    dest_digest: bytes = b""  # SUCCESS: `destination_digest` of the destination prefill wrote


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

_FIELD_TYPES = {"str": str, "int": int, "bool": bool, "bytes": bytes}


def destination_digest(dest: RoomRequest) -> bytes:
    """What identifies a room's destination: the receiver, the aux row, the token count and every row list. Prefill
    sends it with SUCCESS; decode accepts the completion only if it equals the digest of what it registered."""
    h = hashlib.sha256(f"{dest.room}|{dest.receiver_id}|{dest.aux_index}|{dest.num_tokens}".encode())
    for key in sorted(dest.dst_rows):
        h.update(b"|" + key.encode() + b"=")
        h.update(dest.dst_rows[key])
    return h.digest()


def encode(msg: Message, reply_to: str, version: int = PROTOCOL_VERSION,
           envelope: Mapping[str, Any] | None = None) -> bytes:
    body = asdict(msg)
    if "room" in body:
        body["room"] = int(body["room"]).to_bytes(ROOM_BYTES, "big")
    body.update(v=version, type=_NAMES[type(msg)].value, reply_to=reply_to)
    if envelope:
        body.update(envelope)
    return msgpack.packb(body, use_bin_type=True)


def _check_fields(cls: type, body: dict[str, Any]) -> None:
    """Every field of the type present, of its type (dataclasses do not check): a peer's bad input stops here."""
    for f in fields(cls):
        if f.name not in body:
            continue
        value = body[f.name]
        head = str(f.type).split("[", 1)[0].strip()
        expected = _FIELD_TYPES.get(head, dict if head == "dict" else None)
        if expected is None:
            continue
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise TypeError(f"field {f.name!r} is a {type(value).__name__}, not {head}")
    rows = body.get("dst_rows")
    if rows is not None and not all(isinstance(k, str) and isinstance(v, bytes) and len(v) % 4 == 0
                                    for k, v in rows.items()):  # fmt: skip
        raise TypeError("dst_rows must map region names to int32 row bytes")


def decode_envelope(data: bytes) -> tuple[Message, str, dict[str, Any]]:
    """(message, reply_to, envelope fields). Raises ProtocolVersionError for another version, ProtocolError for
    garbage (undecodable, unknown type, missing or extra fields, a field of the wrong type)."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"undecodable control message ({len(data)} bytes): {exc}") from exc
    if not isinstance(body, dict):
        raise ProtocolError(f"control message is a {type(body).__name__}, not a map")
    msg_type, reply_to, version = body.pop("type", None), body.pop("reply_to", ""), body.pop("v", None)
    envelope = {k: body.pop(k) for k in ENVELOPE_FIELDS if k in body}
    if not isinstance(reply_to, str):
        raise ProtocolError(f"control message with a reply_to of type {type(reply_to).__name__}")
    if version != PROTOCOL_VERSION:
        raise ProtocolVersionError(str(msg_type), reply_to, version)
    try:
        cls = _TYPES[MsgType(msg_type)]
        if "room" in body:
            room = body["room"]
            if not isinstance(room, bytes) or len(room) != ROOM_BYTES:
                raise TypeError(f"room must be {ROOM_BYTES} bytes")
            body["room"] = int.from_bytes(room, "big")
        _check_fields(cls, body)
        return cls(**body), reply_to, envelope
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"malformed control message of type {msg_type!r}: {exc}") from exc


def decode(data: bytes) -> tuple[Message, str]:
    """(message, reply_to); see `decode_envelope`."""
    msg, reply_to, _ = decode_envelope(data)
    return msg, reply_to
