"""Which model sizes the GPU kernels run, checked when the engine loads a model (before any weight is read).

The PyTorch reference kernels (kernels/*_ref.py: the CPU path) compute any valid MLA / indexer size. The GPU
kernels are written for the sizes real DSA checkpoints use (DeepSeek-V3.2 and GLM-5 share them): a 576-wide
MLA row (kv_lora_rank 512 + qk_rope_head_dim 64), 128-dim indexer heads, top-k a multiple of the kernel's
64-row tiles, query heads in 64-head blocks (or one block of 16 / 32 heads), bf16 / fp16 activations.
On CUDA a model outside those sizes is refused at load with every mismatch named, unless the user asks for
the reference kernels on the GPU (`--attention-backend torch_native`, SGLang's name for its PyTorch backend).
"""

from __future__ import annotations

from typing import Any

import torch

from kernels.fp8_rows import NOPE_DIM, ROPE_DIM
from kernels.indexer_ref import INDEX_HEAD_DIM

# The `--attention-backend` value that runs the PyTorch reference kernels on any device.
REFERENCE_BACKEND = "torch_native"
TOPK_TILE = 64
HEAD_BLOCK = 64
SMALL_HEAD_COUNTS = (16, 32, 64)


def gpu_kernel_problems(model_config: Any, model_dtype: torch.dtype, tp_size: int = 1) -> list[str]:
    """Every way `model_config` (run in `model_dtype`) falls outside what the GPU kernels support. With tensor
    parallelism a rank's kernels see `num_attention_heads / tp_size` heads: that is the count checked."""
    problems: list[str] = []

    def need(field: str, value: Any, ok: bool, supported: str) -> None:
        if not ok:
            problems.append(f"{field} = {value} (supported: {supported})")

    kv_lora = int(model_config.kv_lora_rank)
    rope = int(model_config.qk_rope_head_dim)
    index_dim = int(model_config.index_head_dim)
    topk = int(model_config.index_topk)
    heads = int(model_config.num_attention_heads) // max(1, tp_size)
    heads_field = "num_attention_heads" if tp_size <= 1 else f"num_attention_heads / tp_size {tp_size}"
    need("kv_lora_rank", kv_lora, kv_lora == NOPE_DIM, f"{NOPE_DIM}")
    need("qk_rope_head_dim", rope, rope == ROPE_DIM, f"{ROPE_DIM}")
    need("index_head_dim", index_dim, index_dim == INDEX_HEAD_DIM, f"{INDEX_HEAD_DIM}")
    need("index_topk", topk, topk > 0 and topk % TOPK_TILE == 0, f"a positive multiple of {TOPK_TILE}")
    need(heads_field, heads, heads in SMALL_HEAD_COUNTS or heads % HEAD_BLOCK == 0,
         f"{', '.join(map(str, SMALL_HEAD_COUNTS))} or a multiple of {HEAD_BLOCK}")
    need("dtype", str(model_dtype).removeprefix("torch."), model_dtype in (torch.bfloat16, torch.float16),
         "bfloat16, float16")
    return problems


def check_kernel_support(
    model_config: Any, device: torch.device, model_dtype: torch.dtype, attention_backend: str, tp_size: int = 1
) -> None:
    """Raise a ValueError naming each unsupported field, its value and what is supported (CUDA only; the
    reference backend and CPU run any valid size)."""
    if device.type != "cuda" or attention_backend == REFERENCE_BACKEND:
        return
    problems = gpu_kernel_problems(model_config, model_dtype, tp_size)
    if problems:
        raise ValueError(
            "the GPU attention and indexer kernels do not support this model: " + "; ".join(problems)
            + f". Pass --attention-backend {REFERENCE_BACKEND} to run the PyTorch reference kernels on the GPU "
            "instead (correct for any size, much slower)."
        )
