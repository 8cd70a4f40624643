"""Tensor-in/tensor-out kernels. Each has a PyTorch reference (`*_ref.py`, the CPU path and the GPU tests'
oracle); the dispatchers below pick the GPU implementation for CUDA tensors and the reference otherwise.
Nothing is compiled at import: the CUDA extension is built on first CUDA use (kernels/cuda_ext.py)."""

from kernels.dispatch import (
    BoundSwapIn,
    backup_rows,
    copy_rows,
    indexer_topk,
    sparse_mla_decode,
    swap_in,
    write_index_rows,
)
from kernels.fp8_rows import pack_fp8_rows, unpack_fp8_rows
from kernels.swap_in_tables import SwapInTables

__all__ = [
    "BoundSwapIn", "SwapInTables", "backup_rows", "copy_rows", "indexer_topk", "pack_fp8_rows", "sparse_mla_decode",
    "swap_in", "unpack_fp8_rows", "write_index_rows",
]
