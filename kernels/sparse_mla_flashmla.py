"""Sparse MLA decode through FlashMLA (the `sgl-flash-mla` wheel; its legacy half keeps the SM90 kernels).

Same contract as kernels/sparse_mla_triton.py: q [B, H, 576] bf16, rows [N, 576] bf16 or [N, 656] uint8 FP8 rows
(FlashMLA's own V3.2 record), indices [B, K] int32 slot ids (−1 = skip) → out [B, H, 512] bf16, lse [B, H] fp32
(natural log; all-skipped: zeros and +inf).

- FP8 rows: `flash_mla_with_kvcache(..., indices, is_fp8_kvcache=True, use_legacy=True)`, the sparse decode
  kernel; the pool is viewed as pages of `page_size(N)` rows, so a slot id is already `page · size + offset`.
- bf16 rows: `flash_mla_sparse_fwd(..., use_legacy=True)`, the sparse prefill kernel with the batch as its
  queries (FlashMLA has no bf16 sparse decode kernel; vLLM does the same).
Applies to 64 or 128 heads, K a multiple of 64 (FP8) or 128 (bf16), on compute capability 9.x. The split-KV
schedule of the FP8 kernel depends only on (B, H, K), so, as with the Triton kernel, the result depends only on
the selected rows and their order, never on the slots that hold them (HiSparse == dense bit for bit).
"""

from __future__ import annotations

import functools
import importlib
from collections import OrderedDict
from types import ModuleType

import torch

D_QK = 576
D_V = 512
FP8_ROW_BYTES = 656
_MAX_SCHED_METAS = 64


@functools.lru_cache(maxsize=1)
def _module() -> ModuleType | None:
    for name in ("flash_mla", "sgl_flash_mla"):
        try:
            mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a wheel built for another torch/CUDA fails in many ways
            continue
        has_legacy = getattr(mod, "has_legacy", None)
        if has_legacy is None or has_legacy():
            return mod
    return None


def flashmla_available(device: torch.device | str | None = None) -> bool:
    """The FlashMLA wheel imports, has its SM90 kernels, and `device` is a Hopper GPU."""
    if not torch.cuda.is_available():
        return False
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return False
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] == 9 and _module() is not None


def flashmla_applies(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor) -> bool:
    """Whether FlashMLA's kernels take these shapes (otherwise the caller uses the Triton kernel)."""
    if q.dim() != 3 or q.shape[2] != D_QK or q.dtype != torch.bfloat16 or q.shape[1] not in (64, 128):
        return False
    if indices.dim() != 2 or indices.shape[0] != q.shape[0] or indices.shape[1] == 0:
        return False
    top_k = indices.shape[1]
    if kv.dtype == torch.uint8:
        return kv.dim() == 2 and kv.shape[1] == FP8_ROW_BYTES and kv.stride(1) == 1 and kv.stride(0) == FP8_ROW_BYTES \
            and top_k % 64 == 0
    return kv.dtype == torch.bfloat16 and kv.dim() == 2 and kv.shape[1] == D_QK and kv.stride(1) == 1 \
        and top_k % 128 == 0


def page_size(num_rows: int) -> int:
    """Rows per FlashMLA page: the largest power of two ≤ 64 that divides the pool (slot = page · size + offset)."""
    size = 64
    while num_rows % size:
        size //= 2
    return size


_sched_metas: OrderedDict[tuple, object] = OrderedDict()
# Metas a CUDA graph read during its capture: the graph replays reads of their tensors, so they are never evicted.
_captured_metas: dict[tuple, object] = {}


def _sched_meta(key: tuple) -> object:
    """One FlashMLA tile-scheduler object per launch shape: computed by the first call, reused by every later
    call of that shape (all layers, all steps), as FlashMLA allows while the shapes stay the same (with
    `indices`, FlashMLA plans from (batch, heads, top-k), not from the data).

    A meta read under CUDA graph capture is kept for the life of the process (the graph's replays read its
    tensors); the graph runner warms every bucket up eagerly first, so its tensors were made outside the graph."""
    meta = _captured_metas.get(key)
    if meta is not None:
        return meta
    if torch.cuda.is_current_stream_capturing():
        meta = _sched_metas.pop(key, None)
        if meta is None:
            meta = _module().get_mla_metadata()[0]
        _captured_metas[key] = meta
        return meta
    meta = _sched_metas.get(key)
    if meta is None:
        meta = _module().get_mla_metadata()[0]
        _sched_metas[key] = meta
        if len(_sched_metas) > _MAX_SCHED_METAS:
            _sched_metas.popitem(last=False)
    else:
        _sched_metas.move_to_end(key)
    return meta


def sparse_mla_decode_flashmla(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring; the caller checks `flashmla_applies` first."""
    mod = _module()
    if mod is None:
        raise RuntimeError("FlashMLA is not installed (pip install 'hisparse-decode-server[flashmla]')")
    if not flashmla_applies(q, kv, indices):
        raise ValueError(f"FlashMLA does not take q {tuple(q.shape)} {q.dtype}, rows {tuple(kv.shape)} {kv.dtype}, "
                         f"indices {tuple(indices.shape)}")
    batch, heads, _ = q.shape
    top_k = indices.shape[1]
    if q.stride(2) != 1:
        q = q.contiguous()
    indices = indices.to(torch.int32)
    if not indices.is_contiguous():
        indices = indices.contiguous()
    if batch == 0:
        return (torch.empty((0, heads, D_V), dtype=q.dtype, device=q.device),
                torch.empty((0, heads), dtype=torch.float32, device=q.device))
    if kv.dtype == torch.uint8:
        n = kv.shape[0]
        size = page_size(n)
        cache = kv.view(n // size, size, 1, FP8_ROW_BYTES)
        meta = _sched_meta((q.device.index, batch, heads, top_k, size))
        out, lse = mod.flash_mla_with_kvcache(
            q.unsqueeze(1), cache, None, None, D_V, meta, softmax_scale=float(scale), causal=False,
            is_fp8_kvcache=True, indices=indices.unsqueeze(1), use_legacy=True,
        )
        return out.squeeze(1), lse[:, :, 0]
    out, _max_logits, lse = mod.flash_mla_sparse_fwd(
        q, kv.unsqueeze(1), indices.unsqueeze(1), float(scale), d_v=D_V, use_legacy=True,
    )
    return out, lse
