"""How one token's MLA row (c_kv ; k_pe: 512 + 64 = 576 values in DeepSeek-V3.2 and GLM-5) is stored in a KV
pool, for each KV dtype, and what a model's caches hold per token (`CacheGeometry`).

Float KV dtypes (bfloat16, float16, float32) store the row's values as they are (`kv_lora_rank +
qk_rope_head_dim` of them, any valid size): values × element size bytes.
FP8 is FlashMLA's 656-byte row (kernels/fp8_rows.py): 512 e4m3 values, 4 fp32 power-of-two scales (one per
128 values) and the 64 RoPE values in bf16. `torch.float8_e4m3fn` stands for that whole row format here, so the
engine's `kv_dtype` stays a `torch.dtype`. The attention dispatcher reads FP8 rows as `[N, 656]` uint8 directly,
so FP8 rows are never unpacked into a pool.

Dense and HiSparse both encode rows with `encode_rows` and hand the attention `attention_rows`, so a token's
stored bytes, and the rows the attention sees, are the same in both modes (the bit-identity contract). FP8 rows exist only for the 512 + 64 row
(`check_fp8_row_format`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from decode_server.model import fused_ops
from kernels.fp8_rows import FP8_ROW_BYTES, NOPE_DIM, ROPE_DIM
from kernels.indexer_ref import INDEX_HEAD_DIM
from kernels.sparse_mla_ref import D_QK, D_V

FP8_KV_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class CacheGeometry:
    """What the KV caches hold per token, from the model config.

    Every layer caches one MLA row of `kv_lora_rank + rope_dim` values. Only the layers that run the lightning
    indexer (`index_layers`; GLM-5's "shared" layers reuse the previous full layer's top-k and have no
    indexer) cache an indexer key: `index_head_dim` FP8 values + one fp32 scale. Defaults: DeepSeek-V3.2.
    """

    num_layers: int
    kv_lora_rank: int = D_V
    rope_dim: int = D_QK - D_V
    index_head_dim: int = INDEX_HEAD_DIM
    index_layers: tuple[int, ...] | None = None  # None: every layer

    @classmethod
    def from_model_config(cls, config: Any) -> CacheGeometry:
        num_layers = int(config.num_hidden_layers)
        full = getattr(config, "index_layer_ids", None)
        return cls(
            num_layers=num_layers,
            kv_lora_rank=int(getattr(config, "kv_lora_rank", D_V)),
            rope_dim=int(getattr(config, "qk_rope_head_dim", D_QK - D_V)),
            index_head_dim=int(getattr(config, "index_head_dim", INDEX_HEAD_DIM)),
            index_layers=tuple(full) if full is not None else None,
        )

    @property
    def row_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def index_layer_ids(self) -> tuple[int, ...]:
        return self.index_layers if self.index_layers is not None else tuple(range(self.num_layers))

    @property
    def num_index_layers(self) -> int:
        return len(self.index_layer_ids)

    def index_slots(self) -> dict[int, int]:
        """layer id → its layer in the indexer-key cache (only layers that run the indexer have one)."""
        return {layer: i for i, layer in enumerate(self.index_layer_ids)}

    @property
    def index_key_bytes(self) -> int:
        """One token's indexer key in one layer: FP8 values + an fp32 scale (132 B for 128 dims)."""
        return self.index_head_dim + 4

    def row_bytes(self, kv_dtype: torch.dtype) -> int:
        return row_bytes(kv_dtype, self.row_dim)

    def bytes_per_token(self, kv_dtype: torch.dtype) -> int:
        """Device bytes one fully cached token costs: MLA rows of all layers + indexer keys of full layers."""
        return self.num_layers * self.row_bytes(kv_dtype) + self.num_index_layers * self.index_key_bytes


def check_fp8_row_format(kv_dtype: torch.dtype, geometry: CacheGeometry) -> None:
    """FP8 KV is FlashMLA's 656-byte row (512 e4m3 + 4 scales + 64 bf16): refuse other row sizes clearly."""
    if is_fp8(kv_dtype) and (geometry.kv_lora_rank, geometry.rope_dim) != (NOPE_DIM, ROPE_DIM):
        raise ValueError(
            f"--kv-cache-dtype fp8_e4m3 stores FlashMLA's 656-byte row, which needs kv_lora_rank {NOPE_DIM} and "
            f"qk_rope_head_dim {ROPE_DIM}; this model has kv_lora_rank {geometry.kv_lora_rank} and "
            f"qk_rope_head_dim {geometry.rope_dim}. Use a float KV cache dtype (auto, bfloat16, float32)."
        )


def is_fp8(kv_dtype: torch.dtype) -> bool:
    return kv_dtype == FP8_KV_DTYPE


def row_bytes(kv_dtype: torch.dtype, row_dim: int = D_QK) -> int:
    """Bytes of one token's row in one layer: 656 for FP8, row_dim (576) × element size otherwise."""
    if is_fp8(kv_dtype):
        return FP8_ROW_BYTES
    return row_dim * torch.empty((), dtype=kv_dtype).element_size()


def storage_layout(kv_dtype: torch.dtype, row_dim: int = D_QK) -> tuple[int, torch.dtype]:
    """(elements per row, element dtype) of a pool tensor that holds rows of `kv_dtype`."""
    if is_fp8(kv_dtype):
        return FP8_ROW_BYTES, torch.uint8
    return row_dim, kv_dtype


def encode_rows(rows: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """[T, row_dim] float rows from the model → rows as a pool stores them ([T, 656] uint8, or kv_dtype)."""
    if is_fp8(kv_dtype):
        return fused_ops.pack_fp8_rows(rows)  # one kernel on CUDA, the same bits
    return rows.to(kv_dtype)


def encode_row_bytes(rows: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """[T, row_dim] float rows → [T, row_bytes] uint8, for the raw-byte pools of HiSparse."""
    return encode_rows(rows, kv_dtype).contiguous().view(torch.uint8)


def attention_rows(raw_rows: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """[N, row_bytes] uint8 pool rows → what `kernels.sparse_mla_decode` takes (FP8 rows stay uint8)."""
    if is_fp8(kv_dtype):
        return raw_rows
    return raw_rows.view(kv_dtype)
