"""Tune the block-FP8 GEMMs of a model before it serves (kernels/fp8_gemm.py `Fp8GemmTuner`).

The engine calls `warm_up` on CUDA before capturing decode graphs, with every token count a forward pass can have
(decode batch sizes, prefill chunks): each FP8 weight shape of the model is timed at each M bucket those counts
fall in, on the model's own weights of that shape (all layers, rotated), and the fastest backend is fixed for the
process. Dense shapes cover the attention, indexer and MLP projections (and the experts' own layers, which
batch-invariant mode runs one by one); grouped shapes the routed experts, at M = tokens × experts per token (one
more per token where the shared expert is fused into their stacks, decode_server/model/moe.py), timed on the
model's routing (each token's distinct experts and its shared-expert row: kernels/fp8_gemm.py
`grouped_routing_samples`); batched shapes MLA's absorbed products with FP8 W_UK / W_UV (one matrix per head,
M = tokens).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Collection, Iterable, Sequence

import torch
from torch import nn

from decode_server.model.attention import MLAAttention
from decode_server.model.batch_invariant import Linear
from decode_server.model.config import ModelConfig
from decode_server.model.layers import MLP
from decode_server.model.moe import MoE
from kernels.fp8_gemm import NO_TABLE_ENTRY, Routing, TuningRecord, m_bucket, tune, tuner
from kernels.fp8_gemm_table import TableKey, dtype_name

logger = logging.getLogger(__name__)

# (kind, every (weight, scales) of one shape, block, extra rows per token: 1 for the grouped GEMMs of a MoE whose
# shared expert is each token's extra choice, else 0).
Workload = tuple[str, list[tuple[torch.Tensor, torch.Tensor]], tuple[int, int], int]


def fp8_workloads(model: nn.Module) -> list[Workload]:
    """(kind, every (weight, scales) of one shape, block, extra rows per token) per FP8 GEMM shape of the model."""
    groups: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    fused: set[int] = set()  # projections that run only as part of a stacked GEMM
    for module in model.modules():
        stacks = ([module.fused_inputs, module.fused_queries] if isinstance(module, MLAAttention)
                  else [module.fused_gate_up] if isinstance(module, MLP) else [])
        for stack in stacks:
            if stack is not None and "weight_scale_inv" in stack.stacked:
                weight, scale = stack.stacked["weight"], stack.stacked["weight_scale_inv"]
                groups.setdefault(("dense", tuple(weight.shape), stack.block, 0), []).append((weight, scale))
                fused.update(id(lin) for lin in stack.linears)
    for name, module in model.named_modules():
        if isinstance(module, MLAAttention) and module.absorbed_fp8:  # the absorbed products, per head
            for weight, scale in ((module.w_uk, module.w_uk_scale), (module.w_uv, module.w_uv_scale)):
                groups.setdefault(("batched", tuple(weight.shape), (128, 128), 0), []).append((weight, scale))
        if name.endswith("kv_b_proj") or id(module) in fused:
            continue  # kv_b_proj: never multiplied as stored (its heads are the absorbed products' weights)
        if isinstance(module, Linear) and module.fp8_scale is not None:
            key = ("dense", tuple(module.weight.shape), module.weight_block, 0)
            groups.setdefault(key, []).append((module.weight, module.fp8_scale))
        elif isinstance(module, MoE) and module.fp8_experts():
            block = module.local_experts()[0].gate_proj.weight_block
            extra = int(module.fuses_shared)
            for weight, scale in module.grouped_gemms():
                groups.setdefault(("grouped", tuple(weight.shape), block, extra), []).append((weight, scale))
    return [(kind, weights, block, extra) for (kind, _, block, extra), weights in groups.items()]


def tuning_config(config: ModelConfig) -> ModelConfig:
    """The config cut to one dense layer and one MoE layer, both running the indexer, plus — for models with
    cross-layer top-k sharing (GLM-5) — one MoE layer that reuses its predecessor's top-k: every FP8 GEMM shape of
    the model at a fraction of its bytes (what benchmarks/tune_fp8_gemm.py builds to measure a GPU's table). A
    shared layer has no indexer, so its input projections stack without the indexer's wk (q_a + kv_a): until
    2026-11-29 that shape was never measured, so GLM-5's shared layers (57 of glm5-rank-ep8's 78) ran q_a and
    kv_a apart, kv_a at the untimed default."""
    shared = "shared" in config.indexer_types
    layers = ("full", "full", "shared") if shared else ("full", "full") if config.indexer_types else ()
    mlp = (("dense", "sparse", "sparse") if shared else ("dense", "sparse")) if config.mlp_layer_types else ()
    return dataclasses.replace(config, num_hidden_layers=3 if shared else 2, first_k_dense_replace=1,
                               indexer_types=layers, mlp_layer_types=mlp)


def _planned(workloads: list[Workload], token_counts: Iterable[int], experts_per_token: int,
             grouped: bool) -> list[tuple[str, list[tuple[torch.Tensor, torch.Tensor]], int, tuple[int, int]]]:
    """(kind, weights, M, block) of every decision `warm_up` makes: each dense and batched shape at each M bucket of
    the token counts, each grouped shape at bucket × rows per token (its rows are token-expert pairs: the experts
    per token, and the shared expert where it is fused)."""
    counts = sorted({max(1, t) for t in token_counts})
    planned = []
    for kind, weights, block, extra in workloads:
        if kind != "grouped":
            planned += [(kind, weights, bucket, block) for bucket in sorted({m_bucket(t) for t in counts})]
        elif grouped:  # the buckets of the row counts themselves: with 3 rows a token, 5 tokens are 15 rows (≤ 16)
            rows = experts_per_token + extra
            planned += [(kind, weights, bucket, block) for bucket in sorted({m_bucket(t * rows) for t in counts})]
    return planned


def table_keys(model: nn.Module, token_counts: Iterable[int], experts_per_token: int,
               grouped: bool = True) -> set[TableKey]:
    """The GPU table keys (kernels/fp8_gemm_table.py) of the decisions `warm_up` would make for these token counts,
    without timing anything (the model may live on the meta device): what a GPU's table must hold for the engine to
    run only measured choices, since a missing key silently takes the untimed default."""
    keys: set[TableKey] = set()
    for kind, weights, m, _ in _planned(fp8_workloads(model), token_counts, experts_per_token, grouped):
        shape = tuple(int(v) for v in weights[0][0].shape)
        experts, n, k = shape if kind in ("grouped", "batched") else (0, *shape)
        keys.add((kind, n, k, experts, m_bucket(m), dtype_name(model.dtype)))
    return keys


def warm_up(model: nn.Module, token_counts: Iterable[int], experts_per_token: int,
            grouped: bool = True, shapes: Collection[tuple[int, int]] | None = None) -> list[TuningRecord]:
    """Decide the backend of every FP8 GEMM shape for every M bucket of `token_counts`; returns the decisions
    made now (already cached keys are skipped). `grouped` False: the routed experts run per expert (batch-invariant
    mode), so only dense shapes are tuned. `shapes`: only the weights of these (N, K) (a table's new shapes)."""
    token_counts = list(token_counts)
    workloads = fp8_workloads(model)
    if shapes is not None:
        wanted = {(int(n), int(k)) for n, k in shapes}
        workloads = [w for w in workloads if tuple(w[1][0][0].shape[-2:]) in wanted]
    if not workloads:
        return []
    dtype = model.dtype
    before = len(tuner().records)
    start = time.perf_counter()
    # The grouped GEMMs are timed on decode's routing (each token's distinct experts and, where fused, its shared
    # expert's row: kernels/fp8_gemm.py `grouped_routing_samples`), except with experts split across ranks, where
    # a rank's share of a token's choices varies and its other rows are sentinels that no kernel reads.
    split = any(m.parallel.expert_parallel for m in model.modules() if isinstance(m, MoE))
    shared = {id(weights): bool(extra) for kind, weights, _, extra in workloads if kind == "grouped"}
    for kind, weights, m, block in _planned(workloads, token_counts, experts_per_token, grouped):
        routing = (Routing(experts_per_token, shared[id(weights)])
                   if kind == "grouped" and not split and experts_per_token > 0 else None)
        tune(kind, weights, m, dtype, block, routing)
    torch.cuda.synchronize()
    made = tuner().records[before:]
    logger.info("FP8 GEMM warm-up: %d shape(s), %d decision(s) in %.1f s", len(workloads), len(made),
                time.perf_counter() - start)
    warn_untabled(made, max(token_counts, default=0))
    return made


def warn_untabled(records: Sequence[TuningRecord], max_tokens: int = 0) -> int:
    """One warning naming the shapes whose decisions this GPU's table lacked (they run the default configuration,
    untimed: GLM-5's FP8 step was slower than its bf16 step that way until its shapes were tuned); returns how many
    decisions that was. Each decision is also logged at INFO as it is made, which is easy to miss. `max_tokens`:
    the warm-up's largest token count, named in the tuning command (the tuner's default stops at 512 tokens, short
    of a prefill chunk's pass)."""
    missing = [r for r in records if r.source == NO_TABLE_ENTRY]
    if missing:
        shapes = sorted({(r.kind, r.n, r.k, r.experts) for r in missing})
        listed = ", ".join(f"{kind} N={n} K={k}" + (f" E={e}" if e else "") for kind, n, k, e in shapes[:8])
        logger.warning("FP8 GEMM warm-up: %d of %d decisions have no entry in this GPU's table and run the default "
                       "configuration, untimed (%d shape(s): %s%s); measure them with benchmarks/tune_fp8_gemm.py "
                       "--configs <model> --parallel <TP>x<EP>%s and ship the table (docs/kernels.md)", len(missing),
                       len(records), len(shapes), listed, ", …" if len(shapes) > 8 else "",
                       f" --max-tokens {m_bucket(max_tokens)}" if max_tokens > 0 else "")
    return len(missing)
