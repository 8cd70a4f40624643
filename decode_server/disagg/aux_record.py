"""The aux record: what a prefill server writes into a decode server's aux row after a room's last KV rows.

Fixed size (`AUX_RECORD_BYTES`, part of the transfer layout both sides compare at handshake), little-endian:

| offset | field | type |
|---|---|---|
| 0 | magic `b"PDAX"` | 4 bytes |
| 4 | version | u16 |
| 6 | number of top logprobs that follow (≤ 20) | u16 |
| 8 | room, low 64 bits (echoed: decode checks it against its own) | u64 |
| 16 | first token id | i64 |
| 24 | prompt length | u32 |
| 28 | flags (bit 0: a logprob is present) | u32 |
| 32 | logprob of the first token | f64 |
| 40 | top logprobs: (token id i64, logprob f64) × 20 | 320 bytes |
| 360 | room, high 64 bits (rooms are 128-bit) | u64 |
| 368..383 | zero padding | |

Decode zeroes the row before it publishes the destination, so a stale record of an earlier room can never pass:
the magic, the version and the echoed room must all match (SGLang checks the echoed room the same way).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from decode_server.engine.types import TokenLogprob

AUX_MAGIC = b"PDAX"
AUX_VERSION = 2  # 2: the room's high 64 bits at offset 360
MAX_TOP_LOGPROBS = 20
AUX_RECORD_BYTES = 384
_HEADER = struct.Struct("<4sHHQqIId")
_TOP = struct.Struct("<qd")
_ROOM_HIGH = struct.Struct("<Q")
_ROOM_HIGH_OFFSET = 360
_U64 = 2**64 - 1
_HAS_LOGPROB = 1


class AuxRecordError(ValueError):
    """The aux row does not hold the record of the expected room (corrupt, stale or from another room)."""


@dataclass(frozen=True)
class AuxRecord:
    room: int
    first_token: int
    prompt_len: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)

    def encode(self) -> bytes:
        if len(self.top_logprobs) > MAX_TOP_LOGPROBS:
            raise ValueError(f"at most {MAX_TOP_LOGPROBS} top logprobs fit in an aux record")
        flags = _HAS_LOGPROB if self.logprob is not None else 0
        out = bytearray(AUX_RECORD_BYTES)
        _HEADER.pack_into(out, 0, AUX_MAGIC, AUX_VERSION, len(self.top_logprobs), self.room & _U64,
                          self.first_token, self.prompt_len, flags, self.logprob or 0.0)  # fmt: skip
        _ROOM_HIGH.pack_into(out, _ROOM_HIGH_OFFSET, (self.room >> 64) & _U64)
        for i, (tok, lp) in enumerate(self.top_logprobs):
            _TOP.pack_into(out, _HEADER.size + i * _TOP.size, tok, lp)
        return bytes(out)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview, expected_room: int) -> AuxRecord:
        if len(data) < AUX_RECORD_BYTES:
            raise AuxRecordError(f"aux row has {len(data)} bytes, expected {AUX_RECORD_BYTES}")
        magic, version, num_top, room, token, prompt_len, flags, logprob = _HEADER.unpack_from(data, 0)
        if magic != AUX_MAGIC:
            raise AuxRecordError("aux row holds no record (the prefill server wrote no metadata)")
        if version != AUX_VERSION:
            raise AuxRecordError(f"aux record version {version}, this server reads version {AUX_VERSION}")
        room |= _ROOM_HIGH.unpack_from(data, _ROOM_HIGH_OFFSET)[0] << 64
        if room != expected_room:
            raise AuxRecordError(f"aux record is for room {room}, expected room {expected_room} (metadata corruption)")
        if num_top > MAX_TOP_LOGPROBS:
            raise AuxRecordError(f"aux record claims {num_top} top logprobs (at most {MAX_TOP_LOGPROBS})")
        top = [_TOP.unpack_from(data, _HEADER.size + i * _TOP.size) for i in range(num_top)]
        return cls(room=room, first_token=token, prompt_len=prompt_len,
                   logprob=logprob if flags & _HAS_LOGPROB else None,
                   top_logprobs=[(int(t), float(v)) for t, v in top])  # fmt: skip

    @classmethod
    def from_token(cls, room: int, prompt_len: int, token: int, logprob: TokenLogprob | None) -> AuxRecord:
        if logprob is None:
            return cls(room=room, first_token=token, prompt_len=prompt_len)
        return cls(room=room, first_token=token, prompt_len=prompt_len, logprob=logprob.logprob,
                   top_logprobs=list(logprob.top_logprobs))

    def token_logprob(self) -> TokenLogprob | None:
        if self.logprob is None:
            return None
        return TokenLogprob(token_id=self.first_token, logprob=self.logprob, top_logprobs=list(self.top_logprobs))
