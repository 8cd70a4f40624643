"""Top-k of the indexer scores with the CUDA radix-select kernel (kernels/csrc/topk_kernels.cu).

Same rule and output as kernels/topk_ref.py (`topk_positions_ref`) and the Triton kernel (kernels/topk_triton.py):
the k visible positions with the largest (order key, −position), in ascending position order; rows with n <= k
visible positions give 0..n−1 then −1. One 1024-thread block per row reads the row twice (a 12-bit histogram, then
the selection of the bins above the threshold bin and the collection of its candidates), refines the threshold
over the candidates in shared memory and writes a bitmap of the selected positions out in order: per row about
a tenth of the Triton kernel's serial steps (docs/kernels.md). Rows wider than the bitmap's shared memory allows
(`max_width`, ~1.4M positions on Hopper) go to the Triton kernel; the engine's callers use `topk_positions`,
which chooses.
"""

from __future__ import annotations

import functools

import torch

from kernels.cuda_ext import load_extension


@functools.cache
def max_width(device_index: int) -> int:
    """Widest row (positions) the CUDA kernel takes on this device."""
    return int(load_extension().topk_rows_max_width(device_index))


def topk_positions_cuda(scores: torch.Tensor, seq_lens: torch.Tensor, top_k: int) -> torch.Tensor:
    """scores [T, L] float32 on the GPU (unit inner stride; positions >= seq_len are never read), seq_lens [T]
    → [T, top_k] int32 (kernels/topk_ref.topk_positions_ref's rule and output). One launch, no host sync."""
    if scores.dim() != 2 or scores.dtype != torch.float32 or scores.stride(1) != 1 or not scores.is_cuda:
        raise ValueError(f"scores must be a float32 [T, L] CUDA tensor with unit inner stride, got {scores.dtype} "
                         f"{tuple(scores.shape)} on {scores.device}")
    if top_k <= 0:
        raise ValueError(f"top_k must be positive, got {top_k}")
    index = scores.device.index if scores.device.index is not None else torch.cuda.current_device()
    if scores.shape[1] > max_width(index):
        raise ValueError(f"rows of {scores.shape[1]} positions are beyond the CUDA top-k kernel's bitmap "
                         f"({max_width(index)} positions on this device); use topk_positions")
    lens = seq_lens.to(device=scores.device, dtype=torch.int64).contiguous()
    if lens.shape != (scores.shape[0],):
        raise ValueError(f"seq_lens must be [{scores.shape[0]}], got {tuple(seq_lens.shape)}")
    return load_extension().topk_rows(scores, lens, top_k)


def topk_positions(scores: torch.Tensor, seq_lens: torch.Tensor, top_k: int) -> torch.Tensor:
    """The engine's top-k on CUDA: the CUDA kernel, or the Triton kernel for rows beyond its width and for CPU
    tensors (Triton's interpreter, the CPU checks). All give the reference's positions, so the choice never
    changes a selection."""
    if scores.is_cuda:
        index = scores.device.index if scores.device.index is not None else torch.cuda.current_device()
        if scores.shape[1] <= max_width(index):
            return topk_positions_cuda(scores, seq_lens, top_k)
    from kernels.topk_triton import topk_positions_triton

    return topk_positions_triton(scores, seq_lens, top_k)
