"""What both sides must agree on before any byte moves; compared at handshake on BOTH sides."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Version of our control protocol (messages.py and the bootstrap routes). Bump on any wire change.
PROTOCOL_VERSION = 2  # 2: 128-bit rooms (16 bytes on the wire), STATUS carries the destination digest


@dataclass(frozen=True)
class TransferLayout:
    model_identity: str  # e.g. the model's architecture + a config hash: two different models must not pair
    num_layers: int
    regions: dict[str, int]  # region name -> row bytes
    kv_dtype: str
    page_size: int
    aux_bytes: int  # bytes of one aux record row
    protocol_version: int = field(default=PROTOCOL_VERSION)

    def mismatch(self, other: TransferLayout) -> str | None:
        """None when the peers can pair; otherwise a sentence naming the first differing field and both values
        ("ours" is self, "peer" is other)."""
        checks = [
            ("protocol version", self.protocol_version, other.protocol_version),
            ("model identity", self.model_identity, other.model_identity),
            ("layer count", self.num_layers, other.num_layers),
            ("region names", sorted(self.regions), sorted(other.regions)),
        ]
        for label, ours, theirs in checks:
            if ours != theirs:
                return f"transfer layout mismatch: {label} differs (ours {ours!r}, peer {theirs!r})"
        for name in sorted(self.regions):
            if self.regions[name] != other.regions[name]:
                return (f"transfer layout mismatch: row bytes of region {name!r} differ "
                        f"(ours {self.regions[name]}, peer {other.regions[name]})")
        for label, ours, theirs in [("KV dtype", self.kv_dtype, other.kv_dtype),
                                    ("page size", self.page_size, other.page_size),
                                    ("aux record bytes", self.aux_bytes, other.aux_bytes)]:
            if ours != theirs:
                return f"transfer layout mismatch: {label} differs (ours {ours!r}, peer {theirs!r})"
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransferLayout:
        try:
            return cls(model_identity=str(d["model_identity"]), num_layers=int(d["num_layers"]),
                       regions={str(k): int(v) for k, v in d["regions"].items()}, kv_dtype=str(d["kv_dtype"]),
                       page_size=int(d["page_size"]), aux_bytes=int(d["aux_bytes"]),
                       protocol_version=int(d["protocol_version"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed transfer layout from peer: {exc!r}") from exc
