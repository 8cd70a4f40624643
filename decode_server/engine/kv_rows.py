"""How one token's MLA row (c_kv 512 ; k_pe 64 = 576 values) is stored in a KV pool, for each KV dtype.

Float KV dtypes (bfloat16, float16, float32) store the 576 values as they are: 576 × element size bytes.
FP8 is FlashMLA's 656-byte row (kernels/fp8_rows.py): 512 e4m3 values, 4 fp32 power-of-two scales (one per
128 values) and the 64 RoPE values in bf16. `torch.float8_e4m3fn` stands for that whole row format here, so the
engine's `kv_dtype` stays a `torch.dtype`. The attention dispatcher reads FP8 rows as `[N, 656]` uint8 directly,
so FP8 rows are never unpacked into a pool.

Dense and HiSparse both encode rows with `encode_rows` and hand the attention `attention_rows`, so a token's
stored bytes, and the rows the attention sees, are the same in both modes (the bit-identity contract).
"""

from __future__ import annotations

import torch

from kernels.fp8_rows import FP8_ROW_BYTES, pack_fp8_rows
from kernels.sparse_mla_ref import D_QK

FP8_KV_DTYPE = torch.float8_e4m3fn


def is_fp8(kv_dtype: torch.dtype) -> bool:
    return kv_dtype == FP8_KV_DTYPE


def row_bytes(kv_dtype: torch.dtype) -> int:
    """Bytes of one token's row in one layer: 656 for FP8, 576 × element size otherwise."""
    if is_fp8(kv_dtype):
        return FP8_ROW_BYTES
    return D_QK * torch.empty((), dtype=kv_dtype).element_size()


def storage_layout(kv_dtype: torch.dtype) -> tuple[int, torch.dtype]:
    """(elements per row, element dtype) of a pool tensor that holds rows of `kv_dtype`."""
    if is_fp8(kv_dtype):
        return FP8_ROW_BYTES, torch.uint8
    return D_QK, kv_dtype


def encode_rows(rows: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """[T, 576] float rows from the model → rows as a pool stores them ([T, 656] uint8, or [T, 576] kv_dtype)."""
    if is_fp8(kv_dtype):
        return pack_fp8_rows(rows)
    return rows.to(kv_dtype)


def encode_row_bytes(rows: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """[T, 576] float rows → [T, row_bytes] uint8, for the raw-byte pools of HiSparse."""
    return encode_rows(rows, kv_dtype).contiguous().view(torch.uint8)


def attention_rows(raw_rows: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """[N, row_bytes] uint8 pool rows → what `kernels.sparse_mla_decode` takes (FP8 rows stay uint8)."""
    if is_fp8(kv_dtype):
        return raw_rows
    return raw_rows.view(kv_dtype)
