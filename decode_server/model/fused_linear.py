"""Several projections of one input as one GEMM (horizontal fusion), without a second copy of their weights.

At decode batch sizes the small projections of a layer are latency-bound: MLA's q_a (7168 → 1536), the indexer's
wk (7168 → 128) and kv_a (7168 → 576) each cost a GEMM launch of ~7–13 µs (docs/benchmarks.md "FP8 weights") while
their bytes need a few µs. They read the same input, so one GEMM over their stacked rows does the work of three
(SGLang fuses q_a and kv_a the same way, `fused_qkv_a_proj_with_mqa`).

The projections keep their modules and parameter names (checkpoints, the loader, the TP shards and the weight
accounting see them as before): each `weight` (and FP8 `weight_scale_inv`, and `bias`) becomes a row slice of one
stacked storage, as the MoE's experts are views into their stacks (decode_server/model/moe.py). Built at model
construction with undefined values, the loader's in-place copies fill the stack; if a parameter is later replaced
(another device, a reload that assigns new tensors) `FusedLinear.current` says so and the caller restacks by copy.

Block FP8: the stacked weight's 128-row scale blocks must line up with each projection's own, so every projection
but the last must have a multiple of the block's rows (q_a 1536 and wk 128 do; kv_a's 576 = 4.5 blocks goes
last). `can_fuse` checks it, and the dtype, device, input width and bias agreement; projections that fail stay
separate. So do FP8 projections whose stacked shape this GPU's FP8 table has not measured (`worth_stacking`);
`benchmarks/tune_fp8_gemm.py` (measure mode, where everything stacks) adds it. The fused GEMM is the same Linear
path (`batch_invariant.linear` / `fp8_linear`), so batch-invariant mode still holds; its rounding may differ from
three separate GEMMs (another kernel shape), but every mode of the engine runs the same fused GEMM.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decode_server.model.batch_invariant import Linear, fp8_linear, linear
from kernels.fp8_gemm import dense_shape_tuned

_ATTRS = ("weight", "weight_scale_inv", "bias")


def can_fuse(linears: Sequence[Linear]) -> bool:
    """Whether these projections of one input can share one stacked weight (module docstring)."""
    if len(linears) < 2:
        return False
    first = linears[0]
    weight = first.weight
    fp8 = first.fp8_scale is not None
    has_bias = first.bias is not None
    for lin in linears:
        w = lin.weight
        if (w.dtype != weight.dtype or w.device != weight.device or w.shape[1] != weight.shape[1]
                or (lin.fp8_scale is not None) != fp8 or (lin.bias is not None) != has_bias):
            return False
        if fp8 and lin.weight_block != first.weight_block:
            return False
    if fp8:
        rows = first.weight_block[0]
        return all(lin.weight.shape[0] % rows == 0 for lin in linears[:-1])
    return True


def worth_stacking(linears: Sequence[Linear]) -> bool:
    """`can_fuse`, and for block-FP8 weights on a GPU the stacked shape has a measured kernel there (the FP8 table
    of this GPU model, or the tuner's measure mode): an untimed default for the stack could be slower than the
    tuned separate GEMMs (H100: 152 against ~104 µs for the dense MLP's gate + up at M 1)."""
    if not can_fuse(linears):
        return False
    weight = linears[0].weight
    if linears[0].fp8_scale is None:
        return True
    return dense_shape_tuned(sum(lin.weight.shape[0] for lin in linears), weight.shape[1], weight.device)


class FusedLinear:
    """`linears` (same input) computed by one GEMM; their parameters are row slices of the stacked tensors."""

    def __init__(self, linears: Sequence[Linear], copy: bool = True) -> None:
        """copy: stack the current values (after loading); False: stacked storage with undefined values, which the
        caller fills through the projections' parameters (model construction, before loading)."""
        if not can_fuse(linears):
            raise ValueError("these projections cannot share one stacked weight (fused_linear.can_fuse)")
        self.linears = list(linears)
        self.sizes = [lin.weight.shape[0] for lin in self.linears]
        self.block = self.linears[0].weight_block
        self.stacked: dict[str, torch.Tensor] = {}
        for attr in _ATTRS:
            params = [lin._parameters.get(attr) for lin in self.linears]
            if params[0] is None:
                continue
            if copy:
                stacked = torch.cat([p.detach() for p in params])
            else:
                rows = sum(p.shape[0] for p in params)
                stacked = torch.empty((rows, *params[0].shape[1:]), dtype=params[0].dtype, device=params[0].device)
            start = 0
            for p in params:
                p.data = stacked[start : start + p.shape[0]]
                start += p.shape[0]
            self.stacked[attr] = stacked

    def current(self) -> bool:
        """True while every projection's parameters are still views into the stacks."""
        for attr, stacked in self.stacked.items():
            ptr = stacked.untyped_storage().data_ptr()
            for lin in self.linears:
                param = lin._parameters.get(attr)
                if param is None or param.untyped_storage().data_ptr() != ptr:
                    return False
        return True

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [T, in] → each projection's output [T, out_i] (column slices of one [T, Σ out_i] result)."""
        weight = self.stacked["weight"]
        bias = self.stacked.get("bias")
        scale = self.stacked.get("weight_scale_inv")
        out = fp8_linear(x, weight, scale, bias, self.block) if scale is not None else linear(x, weight, bias)
        return list(out.split(self.sizes, dim=-1))
