"""Row copies between KV pools on the GPU, either side on the device or in pinned host memory (read or written
through its UVA address): one launch of the backup's row-copy kernel (kernels/csrc/hisparse_kernels.cu) on the
current stream, asynchronous. HiSparse prefill stages a layer's prefix rows host → device with it and writes the
new rows back device → host; the buffer preload uses it host → device for all layers."""

from __future__ import annotations

import torch

from kernels.cuda_ext import load_extension


def copy_rows_cuda(
    src_pool: torch.Tensor, dst_pool: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor
) -> None:
    """dst_pool[:, dst_rows[i]] = src_pool[:, src_rows[i]]; pools [L, N, row_bytes] uint8, each a CUDA tensor or
    pinned host memory; row indices int64 on the GPU (converted here if needed)."""
    for name, pool in (("src_pool", src_pool), ("dst_pool", dst_pool)):
        if not pool.is_cuda and not pool.is_pinned():
            raise ValueError(f"{name} must be a CUDA tensor or pinned host memory (the GPU reads it through UVA)")
    device = src_pool.device if src_pool.is_cuda else dst_pool.device
    src = src_rows.to(device=device, dtype=torch.int64).contiguous()
    dst = dst_rows.to(device=device, dtype=torch.int64).contiguous()
    load_extension().copy_rows(src_pool, dst_pool, src, dst)
