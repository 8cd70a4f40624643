"""Tune the block-FP8 GEMMs of a model before it serves (kernels/fp8_gemm.py `Fp8GemmTuner`).

The engine calls `warm_up` on CUDA before capturing decode graphs, with every token count a forward pass can have
(decode batch sizes, prefill chunks): each FP8 weight shape of the model is timed at each M bucket those counts
fall in, on the model's own weights of that shape (all layers, rotated), and the fastest backend is fixed for the
process. Dense shapes cover the attention, indexer and MLP projections (and the experts' own layers, which
batch-invariant mode runs one by one); grouped shapes the routed experts, at M = tokens × experts per token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable

import torch
from torch import nn

from decode_server.model.attention import MLAAttention
from decode_server.model.batch_invariant import Linear
from decode_server.model.layers import MLP
from decode_server.model.moe import MoE
from kernels.fp8_gemm import TuningRecord, m_bucket, tune, tuner

logger = logging.getLogger(__name__)

Workload = tuple[str, list[tuple[torch.Tensor, torch.Tensor]], tuple[int, int]]


def fp8_workloads(model: nn.Module) -> list[Workload]:
    """(kind, every (weight, scales) of one shape, block) per FP8 GEMM shape of the model."""
    groups: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    fused: set[int] = set()  # projections that run only as part of a stacked GEMM
    for module in model.modules():
        stack = (module.fused_inputs if isinstance(module, MLAAttention)
                 else module.fused_gate_up if isinstance(module, MLP) else None)
        if stack is not None and "weight_scale_inv" in stack.stacked:
            weight, scale = stack.stacked["weight"], stack.stacked["weight_scale_inv"]
            groups.setdefault(("dense", tuple(weight.shape), stack.block), []).append((weight, scale))
            fused.update(id(lin) for lin in stack.linears)
    for name, module in model.named_modules():
        if name.endswith("kv_b_proj") or id(module) in fused:
            continue  # kv_b_proj: never multiplied as stored (absorbed into W_UK / W_UV, bf16, after loading)
        if isinstance(module, Linear) and module.fp8_scale is not None:
            key = ("dense", tuple(module.weight.shape), module.weight_block)
            groups.setdefault(key, []).append((module.weight, module.fp8_scale))
        elif isinstance(module, MoE) and module.fp8_experts():
            block = module.local_experts()[0].gate_proj.weight_block
            for weight, scale in module.stacked():
                groups.setdefault(("grouped", tuple(weight.shape), block), []).append((weight, scale))
    return [(kind, weights, block) for (kind, _, block), weights in groups.items()]


def warm_up(model: nn.Module, token_counts: Iterable[int], experts_per_token: int,
            grouped: bool = True, shapes: Collection[tuple[int, int]] | None = None) -> list[TuningRecord]:
    """Decide the backend of every FP8 GEMM shape for every M bucket of `token_counts`; returns the decisions
    made now (already cached keys are skipped). `grouped` False: the routed experts run per expert (batch-invariant
    mode), so only dense shapes are tuned. `shapes`: only the weights of these (N, K) (a table's new shapes)."""
    workloads = fp8_workloads(model)
    if shapes is not None:
        wanted = {(int(n), int(k)) for n, k in shapes}
        workloads = [w for w in workloads if tuple(w[1][0][0].shape[-2:]) in wanted]
    if not workloads:
        return []
    dtype = model.dtype
    before = len(tuner().records)
    start = time.perf_counter()
    for bucket in sorted({m_bucket(max(1, t)) for t in token_counts}):
        for kind, weights, block in workloads:
            if kind == "grouped":
                if grouped:
                    tune(kind, weights, bucket * experts_per_token, dtype, block)
            else:
                tune(kind, weights, bucket, dtype, block)
    torch.cuda.synchronize()
    made = tuner().records[before:]
    logger.info("FP8 GEMM warm-up: %d shape(s), %d decision(s) in %.1f s", len(workloads), len(made),
                time.perf_counter() - start)
    return made
