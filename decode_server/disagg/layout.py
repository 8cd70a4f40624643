"""The transfer layout of an engine: what prefill and decode compare at handshake before any byte moves."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from decode_server.disagg.aux_record import AUX_RECORD_BYTES
from decode_server.disagg.memory import RegionView
from transfer.layout import TransferLayout

_IDENTITY_FIELDS = ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers",
                    "kv_lora_rank", "qk_rope_head_dim", "index_topk", "index_head_dim", "num_attention_heads")


def model_identity(model_config: Any) -> str:
    """The model's type plus a hash of the config fields that shape its KV (two different models never pair)."""
    fields = {f: getattr(model_config, f, None) for f in _IDENTITY_FIELDS}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"{fields['model_type'] or 'model'}:{digest}"


def engine_layout(engine: Any, regions: dict[str, RegionView]) -> TransferLayout:
    return TransferLayout(
        model_identity=model_identity(engine.model_config),
        num_layers=int(engine.model_config.num_hidden_layers),
        regions={name: r.row_bytes for name, r in regions.items()},
        kv_dtype=str(engine.kv_dtype).removeprefix("torch."),
        page_size=int(engine.config.page_size),
        aux_bytes=AUX_RECORD_BYTES,
    )
