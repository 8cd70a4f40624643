"""Batch-invariant arithmetic for `--enable-deterministic-inference` (a request's output never depends on its batch).

A GEMM kernel's choice of blocking, split-K and threading depends on the matrix shape, so the float rounding of a
token's row changes with how many other rows share the call (M). With the mode on, every operation whose kernel
sees the number of tokens runs on fixed-size row tiles instead: the input's rows are padded to a multiple of
`ROW_TILE` and processed `ROW_TILE` rows per call, so each kernel always sees the same shape and a row's result
depends only on that row. This covers the model's linear layers (block-FP8 ones too: their GEMMs then always see 64 rows, so their
backend and launch configuration are fixed), the absorbed MLA matmuls, the indexer's
projections and Hadamard rotation, RMSNorm / LayerNorm (row reductions whose GPU launch configuration depends on
the row count), the router, and the routed experts (which run per expert, on tiles, instead of as one grouped GEMM).
Attention and indexer kernels are per query already; the attention backend additionally fixes its query tiles
and split counts while the mode is on (engine/dense_backend.py).

The mode is a context variable that the engine sets around each forward pass, so engines with and without it can
live in one process. Its cost is the padding (at most ROW_TILE - 1 wasted rows per call) and the extra calls.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fp8_gemm import fp8_batched_linear as _fp8_batched_linear
from kernels.fp8_gemm import fp8_linear as _fp8_linear

ROW_TILE = 64

_enabled: contextvars.ContextVar[bool] = contextvars.ContextVar("batch_invariant", default=False)


def enabled() -> bool:
    return _enabled.get()


@contextlib.contextmanager
def batch_invariant_mode(on: bool = True) -> Iterator[None]:
    token = _enabled.set(on)
    try:
        yield
    finally:
        _enabled.reset(token)


def _tiles(x: torch.Tensor) -> tuple[torch.Size, int, list[torch.Tensor]]:
    """x [..., K] → (leading dims, row count n, ROW_TILE-row tiles of the zero-padded rows)."""
    lead, width = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, width)
    n = rows.shape[0]
    pad = (-n) % ROW_TILE
    if pad or n == 0:
        rows = torch.cat((rows, rows.new_zeros(pad or ROW_TILE, width)))
    return lead, n, [rows[i : i + ROW_TILE].contiguous() for i in range(0, rows.shape[0], ROW_TILE)]


def on_row_tiles(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn over the rows of x [..., K] (leading dims flattened), ROW_TILE zero-padded rows per call."""
    lead, n, tiles = _tiles(x)
    out = torch.cat([fn(tile) for tile in tiles])[:n]
    return out.reshape(*lead, out.shape[-1])


def on_row_tiles_pair(
    fn: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`on_row_tiles` for a row-wise fn with two outputs [rows, N1] and [rows, N2] (the MoE router's weights and
    expert ids). Element-wise CPU kernels round the elements of a vectorized body and of a scalar tail differently,
    and where the tail starts depends on the tensor's size: a small op such as the router's sigmoid over [T, 8]
    must see a fixed row count too, not only the GEMMs."""
    lead, n, tiles = _tiles(x)
    parts = [fn(tile) for tile in tiles]
    first, second = torch.cat([p[0] for p in parts])[:n], torch.cat([p[1] for p in parts])[:n]
    return first.reshape(*lead, first.shape[-1]), second.reshape(*lead, second.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, on fixed row tiles while the mode is on."""
    if not enabled():
        return F.linear(x, weight, bias)
    return on_row_tiles(lambda rows: F.linear(rows, weight, bias), x)


def matmul_rows(x: torch.Tensor, w: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """x [T, groups·K] viewed as [T, groups, K], each group @ w [K, N] → [T, groups·N]; while the mode is on, on
    tiles of ROW_TILE rows of x (so ROW_TILE·groups rows per GEMM, always the same)."""
    def fn(rows: torch.Tensor) -> torch.Tensor:
        return (rows.view(rows.shape[0], groups, -1) @ w).view(rows.shape[0], -1)

    return on_row_tiles(fn, x) if enabled() else fn(x)


def batched_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [G, M, K] @ b [G, K, N] (one GEMM per group g); while the mode is on, M is cut into fixed row tiles."""
    if not enabled():
        return torch.matmul(a, b)
    groups, m, k = a.shape
    pad = (-m) % ROW_TILE or (ROW_TILE if m == 0 else 0)
    if pad:
        a = torch.cat((a, a.new_zeros(groups, pad, k)), dim=1)
    outs = [torch.matmul(a[:, i : i + ROW_TILE].contiguous(), b) for i in range(0, a.shape[1], ROW_TILE)]
    return torch.cat(outs, dim=1)[:, :m]


def layer_norm(x: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """F.layer_norm with the module's parameters in x's dtype (float32 in the indexer), on row tiles if on."""
    def fn(rows: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(rows, norm.normalized_shape, norm.weight.to(rows.dtype), norm.bias.to(rows.dtype),
                            norm.eps)

    return on_row_tiles(fn, x) if enabled() else fn(x)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
               block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Block-FP8 x @ dequant(weight)ᵀ (kernels/fp8_gemm.py), on fixed row tiles while the mode is on."""
    if not enabled():
        return _fp8_linear(x, weight, scale_inv, bias, block)
    return on_row_tiles(lambda rows: _fp8_linear(rows, weight, scale_inv, bias, block), x)


def fp8_batched_matmul(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor,
                       block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Block-FP8 a[g] [M, K] @ dequant(w[g])ᵀ into out[g] [M, N] per group (kernels/fp8_gemm.py
    `fp8_batched_linear`: MLA's absorbed matmuls with FP8 weights); while the mode is on, ROW_TILE zero-padded rows
    per call, so the kernel's configuration never depends on the token count."""
    if not enabled():
        return _fp8_batched_linear(a, w, w_scale, out, block)
    groups, m, k = a.shape
    for start in range(0, m, ROW_TILE):
        rows = a[:, start : start + ROW_TILE]
        pad = ROW_TILE - rows.shape[1]
        if pad:
            rows = torch.cat((rows, rows.new_zeros(groups, pad, k)), dim=1)
        out[:, start : start + ROW_TILE] = _fp8_batched_linear(rows, w, w_scale, None, block)[:, : ROW_TILE - pad]
    return out


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) that runs on fixed row tiles in batch-invariant mode.

    `use_fp8_storage` turns it into a block-FP8 layer as DeepSeek's checkpoints store it: `weight` float8_e4m3fn
    [out, in] and `weight_scale_inv` float32 [ceil(out/128), ceil(in/128)] (decode_server/model/quantization.py);
    its GEMM then runs in FP8 (kernels/fp8_gemm.py). Subclasses compute through `project`, so the tensor-parallel
    layers work in either form."""

    weight_block: tuple[int, int] = (128, 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, self.bias)

    def project(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        scale = self.fp8_scale
        if scale is not None:
            return fp8_linear(x, self.weight, scale, bias, self.weight_block)
        return linear(x, self.weight, bias)

    @property
    def fp8_scale(self) -> torch.Tensor | None:
        """`weight_scale_inv` when the weight is stored in FP8, else None."""
        return self._parameters.get("weight_scale_inv")

    def use_fp8_storage(self, block: tuple[int, int] = (128, 128)) -> None:
        """Replace the weight by an (uninitialized) FP8 weight + block scales on the weight's device (the meta
        device when the model is being built). A sharded weight's scales are cut the same way (its pieces must
        start and end on block edges: decode_server/model/quantization.py checks it)."""
        out_features, in_features = self.weight.shape
        device = self.weight.device
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        scale_shape = (-(-out_features // block[0]), -(-in_features // block[1]))
        self.weight_scale_inv = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32, device=device),
                                             requires_grad=False)
        self.weight_block = (int(block[0]), int(block[1]))
        shards = getattr(self, "shards", None)
        if shards is not None and "weight" in shards:
            shards["weight_scale_inv"] = shards["weight"]
