"""Decode throughput, dense vs HiSparse, under the same device KV budget (issue 4).

For each context length L and each mode, the engine is built with a fixed device KV budget, filled with as many
requests as fit (each with synthetic KV of L tokens injected straight into the pools: no prefill), and then
timed over N decode steps of the real engine loop (schedule → forward → sample). Modes:
  dense            all KV on the device (the baseline)
  hisparse         host pool + device buffers; the model's own indexer picks the top-k
  hisparse-mX      same, but the indexer's top-k is replaced by a synthetic trace with miss rate ≈ X %
                   (the indexer still runs, so its cost is counted): each layer selects a window of K positions
                   over a random permutation of the context that advances by X % of K per step.
  ...+pf           HiSparse with `prefetch_shared_layers` (--hisparse-prefetch-shared-layers on|both): GLM-5
                   shared layers' swap-ins start at their full layer on a side stream (issue 23 item 3); the
                   synthetic trace replaces full layers' top-k only, so shared layers miss like their full layer.
  ...+early        HiSparse with `early_swap_in` (--hisparse-early-swap-in on|both): each layer's swap-in starts
                   right after its selection, on a side stream, instead of at its attention (issue 23 item 4).
  ...+spec         HiSparse with `speculative_prefetch` (--hisparse-speculative-prefetch on|both): each full layer
                   swaps its top-k into the next full layer's buffer on a side stream, a bet on that layer's
                   selection (issue 23 item 3); --cross-layer-overlap C makes a share C of every layer's synthetic
                   window common to all layers, so adjacent layers' selections (and misses) overlap by C.
  ...+cbN          those side-stream swap-ins with their copy kernel capped at N blocks
                   (--hisparse-side-copy-blocks N ...; HiSparseConfig side_stream_copy_blocks).
  ...+pq           any mode with the indexer's scores by the per-query kernel (`FastScoresConfig(balanced=False)`,
                   the default until 2026-11-28) instead of the balanced split (--indexer-split per-query|both).
`--mixed-contexts`: each request's context uniform in [L/8, L] (seeded) instead of all L, as in a serving batch;
with synthetic miss rates each request's window slides over its own context (a request whose whole context fits
its device buffer then hits every step, as it would in serving).
Reports batch, tokens/s, step time, hit rate and PCIe bytes per step; writes JSON and a PNG plot.

GPU:   python benchmarks/bench_decode.py --contexts 8192 32768 65536 --device-kv-budget-gib 8
CPU:   python benchmarks/bench_decode.py --smoke      (tiny-dsa, tiny contexts; checks the script end to end)

Tensor parallelism (`--tp-size N`): N rank processes (GPU r for rank r), each with the same engine over its model
shard (decode_server/parallel/), the device budget per GPU, and one HiSparse host
pool for all of them in shared memory (decode_server/hisparse/shared_host.py). Every rank runs the same steps;
rank 0 times them and reports, besides tokens/s, the host pool's size and the node's shared memory it really
took (`Shmem` of /proc/meminfo before and after the KV was injected): one copy per node, not one per rank.
GPU:   python benchmarks/bench_decode.py --tp-size 2 --contexts 32768 --device-kv-budget-gib 8
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import platform
import re
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from tqdm import tqdm

from decode_server.config import EngineConfig, HiSparseConfig
from decode_server.engine import kv_sizing, pinned
from decode_server.engine.cuda_graph import (
    DecodeGraphRunner,
    bucket_for,
    graphs_off_reason,
    resolve_batch_sizes,
)
from decode_server.engine.engine import Engine, resolve_attention_kernel, resolve_overlap_schedule
from decode_server.engine.kv_rows import CacheGeometry, encode_row_bytes, encode_rows
from decode_server.engine.memory import (
    available_host_memory,
    device_kv_budget,
    resolve_kv_dtype,
    resolve_model_dtype,
)
from decode_server.engine.request import Request
from decode_server.engine.sampling_params import SamplingParams
from decode_server.errors import DecodeServerError
from decode_server.hisparse.coordinator import HiSparseCoordinator, HiSparseLayout
from decode_server.hisparse.prefetch import shared_followers
from decode_server.model import build_random_model, load_config
from decode_server.model.weights import weight_bytes
from kernels import indexer_fast
from kernels.dispatch import copy_rows
from kernels.indexer_ref import quantize_index_keys

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline  # noqa: E402

logger = logging.getLogger("bench_decode")
GIB = 1 << 30
# One expert-parallel rank's share of the real models (issue 22): memory planned like the server, FP8 weights and
# FP8 KV rows by default.
RANK_CONFIGS = ("dsv32-rank-ep8", "dsv32-rank-ep16", "glm5-rank-ep8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None,
                   help="model config name in configs/ or a checkpoint dir (default dsv32-bench; tiny-dsa with --smoke)")
    p.add_argument("--contexts", type=int, nargs="*", default=None,
                   help="default 8192 32768 65536; none (the flag alone): only the --sweep-kv-gib-per-layer runs")
    p.add_argument("--device-kv-budget-gib", type=float, default=None,
                   help="fixed device bytes for KV + indexer keys (default 8; with --plan-memory or a rank config: "
                        "the engine's own budget, measured)")
    p.add_argument("--host-kv-budget-gib", type=float, default=None,
                   help="pinned host bytes for HiSparse KV (default 40); with planned memory a cap on the pool sized "
                        "for HiSparse's batch (default: no cap besides --host-memory-fraction)")
    p.add_argument("--plan-memory", action="store_true",
                   help="size memory like the server (issue 22): the device KV budget is the engine's own "
                        "(decode_server/engine/memory.py device_kv_budget: free device memory once the model is "
                        "built, minus (1 - --mem-fraction-static) of the device for activations and CUDA graphs), "
                        "the same for dense and HiSparse; HiSparse's pinned host pool is sized for the batch that "
                        "budget holds (kv_sizing.best_hisparse_batch), capped by --host-kv-budget-gib and "
                        "--host-memory-fraction of the host's available memory. Default for the rank configs")
    p.add_argument("--mem-fraction-static", type=float, default=EngineConfig().mem_fraction_static,
                   help="the server's --mem-fraction-static (planned memory)")
    p.add_argument("--host-memory-fraction", type=float, default=kv_sizing.HOST_AVAILABLE_FRACTION,
                   help="planned memory: the host pool pins at most this share of MemAvailable (the engine's rule "
                        "is 0.5; the device machine has 128 GiB of host memory for one GPU)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="a reduced-layer variant of the config: its first N layers (layer kinds kept)")
    p.add_argument("--sweep-kv-gib-per-layer", type=float, nargs="*", default=[],
                   help="budget sweep: also run dense and HiSparse (--sweep-miss-rates) at --sweep-context with a "
                        "device KV budget of this many GiB per layer (e.g. 0.25 0.5 1 2); budgets above the planned "
                        "one are skipped")
    p.add_argument("--sweep-context", type=int, default=32768)
    p.add_argument("--sweep-miss-rates", type=float, nargs="*", default=[0.05])
    p.add_argument("--steps", type=int, default=20, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-batch", type=int, default=512, help="cap on requests per mode")
    p.add_argument("--batch-sizes", type=int, nargs="*", default=[1],
                   help="also run each mode at these fixed batch sizes (e.g. 1: step time at batch 1)")
    p.add_argument("--modes", nargs="+", default=["dense", "hisparse"], choices=["dense", "hisparse"])
    p.add_argument("--miss-rates", type=float, nargs="*", default=[0.05, 0.15],
                   help="synthetic top-k trace miss rates for extra HiSparse runs (empty: none)")
    p.add_argument("--batch-miss-rates", type=float, nargs="*", default=[],
                   help="also run HiSparse at each --batch-sizes batch with these synthetic miss rates (how much a "
                        "step's misses cost at a fixed batch: 0 against 0.2, issue 13 item 8)")
    p.add_argument("--skip-model-indexer-run", action="store_true",
                   help="leave out the full-batch HiSparse run on the model's own (random-weight) indexer top-k")
    p.add_argument("--buffer-size", type=int, default=None, help="HiSparse D (default 2 * index_topk)")
    p.add_argument("--num-recent", type=int, default=4)
    p.add_argument("--hisparse-prefetch-shared-layers", default="on", choices=["on", "off", "both"],
                   help="HiSparse runs with the GLM-5 shared-layer prefetch (HiSparseConfig prefetch_shared_layers): "
                        "on (the server's default; modes named ...+pf on models with shared layers), off, or both, "
                        "each HiSparse run twice (issue 23 item 3)")
    p.add_argument("--hisparse-early-swap-in", default="off", choices=["on", "off", "both"],
                   help="HiSparse runs with the early swap-in (HiSparseConfig early_swap_in): off (the server's "
                        "default), on (modes named ...+early), or both, each HiSparse run twice (issue 23 item 4)")
    p.add_argument("--hisparse-speculative-prefetch", default="off", choices=["on", "off", "both"],
                   help="HiSparse runs with the speculative prefetch (HiSparseConfig speculative_prefetch): off (the "
                        "server's default), on (modes named ...+spec), or both (issue 23 item 3)")
    p.add_argument("--mixed-contexts", action="store_true",
                   help="each request's context uniform in [L/8, L] (seeded) instead of L; synthetic miss rates then "
                        "slide each request's window over its own context (no --cross-layer-overlap, no budget "
                        "sweep)")
    p.add_argument("--indexer-split", default="balanced", choices=["balanced", "per-query", "both"],
                   help="the indexer scores kernel: the balanced split (the default), the per-query kernel (modes "
                        "named ...+pq), or both, each run twice")
    p.add_argument("--cross-layer-overlap", type=float, nargs="+", default=[0.0], metavar="C",
                   help="the synthetic selections' share common to all layers (SyntheticTopK); several values run "
                        "every synthetic HiSparse and dense-mX run once per value (modes ...@ovC)")
    p.add_argument("--dense-synthetic-topk", action="store_true",
                   help="also run dense over the synthetic selection of each --miss-rates rate (and, at the fixed "
                        "batches, each --batch-miss-rates rate; modes dense-mX): the fair baseline for hisparse-mX, "
                        "which pays the synthetic selection's own kernels (SyntheticTopK)")
    p.add_argument("--hisparse-side-copy-blocks", type=copy_blocks_arg, nargs="+", default=None, metavar="N",
                   help="HiSparse runs whose swap-ins run on a side stream (+pf, +early, +spec) once per N, with the "
                        "copy kernel's grid capped at N blocks (HiSparseConfig side_stream_copy_blocks; 0: no cap; "
                        "auto: by the batch; modes named ...+cbN); default: the config's default, no suffix")
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "bfloat16", "fp8_e4m3"],
                   help="KV rows: the model dtype (bf16, 1152 B) or FlashMLA's FP8 rows (656 B); default auto, "
                        "fp8_e4m3 for the rank configs")
    p.add_argument("--quantization", default=None, choices=["none", "fp8"],
                   help="weights of the random model: the model dtype, or block FP8 drawn on the device (FP8 GEMMs; "
                        "CPU runs keep the reference GEMMs); default none, fp8 for the rank configs")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "flashmla", "triton"],
                   help="sparse MLA kernel (auto: FlashMLA on Hopper when installed, else Triton)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--tp-size", type=int, default=1,
                   help="tensor-parallel ranks (processes; one GPU each on CUDA); budgets are per GPU")
    p.add_argument("--ep-size", type=int, default=1, help="expert parallelism over the ranks (1 or --tp-size)")
    p.add_argument("--dp-size", type=int, default=1,
                   help="with --enable-dp-attention: attention replicas (= --tp-size); each rank then runs its own "
                        "batch (the budgets are per GPU) and tok/s counts every rank's tokens")
    p.add_argument("--enable-dp-attention", action="store_true",
                   help="data-parallel attention (the server's flag): each rank its own requests, KV and host pool")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="run decode steps eagerly (default on CUDA: CUDA graphs, as the server runs them)")
    p.add_argument("--cuda-graph-all-buckets", action="store_true",
                   help="capture every default bucket (the server's capture cost), not only the one a run needs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sampling", default="greedy", choices=["greedy", "penalized"],
                   help="penalized: every request also has frequency 0.5, presence 0.3 and repetition 1.1 penalties "
                        "and a logit bias of 16 ids (engine/logits_processor.py), to measure what they add a step")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="batch-invariant mode (docs/models.md): measure its cost against a run without it")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="read each step's tokens before launching the next (overlap is on by default on CUDA): "
                        "run once with and once without to measure what overlap scheduling gains")
    p.add_argument("--out", default=None, help="JSON results (default benchmarks/results/bench_decode[_smoke].json)")
    p.add_argument("--plot", default=None, help="PNG plot (default next to the JSON)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes on CPU: tiny-dsa (or --config), 2 contexts, 3 steps")
    p.add_argument("--profile-dir", default=None,
                   help="after the timed steps of each run, profile 2 more steps with torch.profiler and write the "
                        "top operators by self CPU and by device time to <dir>/profile_<mode>_<context>.txt (on CUDA "
                        "also its Chrome trace, profile_<mode>_<context>.trace.json)")
    args = p.parse_args(argv)
    if args.smoke:
        args.config = args.config or "tiny-dsa"  # tiny-glm5 checks the shared-layer prefetch switch
        args.contexts = [192, 384] if args.contexts is None else args.contexts
        if not args.plan_memory:  # planned memory on the CPU: the engine's CPU budget, a host pool for the batch
            args.device_kv_budget_gib = 4 / 1024
            args.host_kv_budget_gib = 64 / 1024
        args.steps, args.warmup, args.max_batch = 3, 1, 8
        args.batch_sizes = [1]
        args.page_size = 16
        args.device = "cpu" if args.device == "auto" else args.device
    args.config = args.config or "dsv32-bench"
    if args.mixed_contexts and (args.sweep_kv_gib_per_layer or any(c != 0.0 for c in args.cross_layer_overlap)):
        p.error("--mixed-contexts takes no --sweep-kv-gib-per-layer and no --cross-layer-overlap other than 0 (the "
                "sweep and the shared windows assume one context length)")
    if args.enable_dp_attention and args.dp_size != args.tp_size:
        p.error(f"--enable-dp-attention needs --dp-size equal to --tp-size ({args.tp_size}), got {args.dp_size}")
    if args.dp_size != 1 and not args.enable_dp_attention:
        p.error("--dp-size needs --enable-dp-attention")
    if args.ep_size not in (1, args.tp_size):
        p.error(f"--ep-size must be 1 or --tp-size ({args.tp_size}), got {args.ep_size}")
    args.contexts = [8192, 32768, 65536] if args.contexts is None else args.contexts
    rank = args.config in RANK_CONFIGS
    args.plan_memory = args.plan_memory or (rank and args.device_kv_budget_gib is None)
    if args.device_kv_budget_gib is None and not args.plan_memory:
        args.device_kv_budget_gib = 8.0
    if args.host_kv_budget_gib is None and not args.plan_memory:
        args.host_kv_budget_gib = 40.0
    args.kv_cache_dtype = args.kv_cache_dtype or ("fp8_e4m3" if rank else "auto")
    args.quantization = args.quantization or ("fp8" if rank else "none")
    stem = "bench_decode_smoke" if args.smoke else "bench_decode"
    args.out = args.out or f"benchmarks/results/{stem}.json"
    args.plot = args.plot or str(Path(args.out).with_suffix(".png"))
    return args


class SyntheticTopK:
    """Replaces the indexer's decode top-k with a window over a per-(request, layer) random permutation of the
    context, advancing by `miss_rate * K` positions per step: every entering position was last selected long
    ago, so it misses, and the rest were selected one step earlier, so they hit.

    `cross_layer_overlap` C (0 by default: each layer's window starts at its own random offset of the request's
    permutation): the permutation is cut in two regions; round(C·K) of each layer's positions are a window over
    the first region at an offset every layer shares, the rest a window over the second region at the layer's own
    offset, both advancing by the miss rate of their size. So any two layers' selections share C·K positions and
    the positions entering a layer this step (its misses) are, for the share C, the ones entering every other
    layer too: the cross-layer correlation a speculative prefetch bets on (IndexCache, arXiv 2603.12201, measured
    70-100 % top-k overlap between adjacent DSA layers).

    Making the window costs ~8 small kernels a layer (~17 µs at batch 1 on an H200, ~1 ms a step of the 61-layer
    rank), which the real selection does not run: a HiSparse-against-dense comparison at a small batch gives dense
    the same window (--dense-synthetic-topk, `dense-mX`), so both steps carry it and differ only in HiSparse's own
    work."""

    def __init__(self, engine: Engine, context: int, miss_rate: float, seed: int,
                 cross_layer_overlap: float = 0.0, row_contexts: dict[int, int] | None = None) -> None:  # fmt: skip
        """`row_contexts` (--mixed-contexts): request row → its context when they differ; each request's window
        then slides over a permutation of its own context (rows not named, the scratch row among them, over
        `context`); no cross-layer overlap with them."""
        if not 0.0 <= cross_layer_overlap <= 1.0:
            raise ValueError(f"cross_layer_overlap must be in [0, 1], got {cross_layer_overlap}")
        if row_contexts and cross_layer_overlap:
            raise ValueError("a cross-layer overlap needs one context for every request (no row_contexts)")
        if row_contexts and not all(0 < c <= context for c in row_contexts.values()):
            raise ValueError(f"row contexts must be in [1, {context}], got {sorted(set(row_contexts.values()))}")
        self.engine = engine
        self.context = context
        top_k = int(engine.model_config.index_topk)
        self.advance = max(1, round(miss_rate * top_k))
        # The common part (every layer) and each layer's own part of a selection, and the regions they run over.
        self.common = round(cross_layer_overlap * top_k)
        self.own = top_k - self.common
        self.common_region = 0 if self.common == 0 else context if self.own == 0 else context // 2
        self.own_region = context - self.common_region
        # With lengths of their own (no overlap: one region, the whole context) the shortest request must hold it.
        own_region = min(row_contexts.values()) if row_contexts else self.own_region
        for part, region in ((self.common, self.common_region), (self.own, own_region)):
            if part and region < part + self.advance:
                raise ValueError(f"context {region if row_contexts else context} is too short for a synthetic "
                                 f"window of {part} positions advancing {self.advance} a step")
        self.common_advance = round(self.advance * self.common / top_k)
        self.own_advance = self.advance - self.common_advance
        gen = torch.Generator().manual_seed(seed)
        # One permutation per request row, the scratch row of padded (CUDA graph) batches included (shared by
        # layers, which start at different offsets).
        rows = max(engine.config.max_running_requests, engine.kv.backend.scratch_row) + 1
        if row_contexts:
            lengths = [row_contexts.get(row, context) for row in range(rows)]
            # Each row's first `length` entries are a permutation of its positions (the rest is never read).
            self.perm = torch.stack([torch.cat([torch.randperm(n, generator=gen), torch.zeros(context - n,
                                                                                          dtype=torch.int64)])
                                     for n in lengths]).to(engine.device, torch.int32)
            self.lengths: torch.Tensor | None = torch.tensor(lengths, dtype=torch.int64, device=engine.device)
        else:
            self.perm = torch.stack([torch.randperm(context, generator=gen) for _ in range(rows)]).to(
                engine.device, torch.int32)
            self.lengths = None
        num_layers = int(engine.model_config.num_hidden_layers)
        # Each layer's window start lives on the device and advances in place, so a captured step advances it.
        self.start = torch.randint(0, context, (num_layers,), generator=gen).to(engine.device)
        # With an overlap: one start for the common windows (all layers at the same offset), advanced once a step.
        self.common_start = torch.zeros((), dtype=torch.int64, device=engine.device)
        self.first_layer = min(CacheGeometry.from_model_config(engine.model_config).index_layer_ids)
        backend = engine.kv.backend
        self.original = backend.index_topk
        backend.index_topk = self.index_topk

    def index_topk(self, layer_id: int, q: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
        real = self.original(layer_id, q, weights, top_k)  # keep the indexer's cost in the step
        current = self.engine.kv.backend._current()
        batch = current[0] if isinstance(current, tuple) else current  # DenseBackend: (batch, slots, rows)
        if not batch.is_decode:
            return real
        if self.lengths is not None:  # each request's window over its own context
            lengths = self.lengths[batch.req_rows].unsqueeze(1)
            cols = (self.start[layer_id] + torch.arange(top_k, device=q.device)).unsqueeze(0) % lengths
            self.start[layer_id] += self.advance
            return batch.mask_padded_topk(torch.gather(self.perm[batch.req_rows], 1, cols).contiguous())
        if self.common == 0:
            cols = (self.start[layer_id] + torch.arange(top_k, device=q.device)) % self.context
            self.start[layer_id] += self.advance
            return batch.mask_padded_topk(self.perm[batch.req_rows][:, cols].contiguous())
        if layer_id == self.first_layer:  # a new step: the common window moves once, before any layer reads it
            self.common_start += self.common_advance
        common = (self.common_start + torch.arange(self.common, device=q.device)) % self.common_region
        own = self.common_region + (self.start[layer_id] + torch.arange(self.own, device=q.device)) % max(
            1, self.own_region)
        self.start[layer_id] += self.own_advance
        cols = torch.cat([common, own])
        return batch.mask_padded_topk(self.perm[batch.req_rows][:, cols].contiguous())


def hisparse_layout(args, model_config, kv_dtype, context: int, max_len: int, batch_cap: int,
                    device_budget: int) -> tuple[HiSparseLayout, dict]:
    """The HiSparse pools for requests of `max_len` tokens and what sized them: planned like the server
    (`planned_hisparse_layout`) or, with a fixed budget, the quick check's rule (`fixed_hisparse_layout`)."""
    if args.plan_memory:
        return planned_hisparse_layout(args, model_config, kv_dtype, context, max_len, batch_cap, device_budget)
    return fixed_hisparse_layout(args, model_config, kv_dtype, context, max_len, batch_cap, device_budget), {}


def host_pool_cap(args) -> tuple[int, str]:
    """Planned memory: the most host memory the HiSparse pool may pin, and why (--host-kv-budget-gib and
    --host-memory-fraction of MemAvailable; pinning more than the machine has takes the whole host down)."""
    caps = {}
    if args.host_kv_budget_gib is not None:
        caps["--host-kv-budget-gib"] = int(args.host_kv_budget_gib * GIB)
    available = available_host_memory()
    if available is not None:
        caps[f"{args.host_memory_fraction:g} x MemAvailable ({available / GIB:.1f} GiB)"] = int(
            args.host_memory_fraction * available)
    if not caps:
        raise ValueError("planned memory needs --host-kv-budget-gib where MemAvailable is unknown")
    name = min(caps, key=lambda k: caps[k])
    return caps[name], name


def planned_hisparse_layout(args, model_config, kv_dtype, context: int, max_len: int, batch_cap: int,
                            device_budget: int) -> tuple[HiSparseLayout, dict]:
    """The engine's own layout (kv_sizing.hisparse_layout: staging area, indexer keys, buffers) for the device
    budget, with the host pool sized for the batch that budget holds (kv_sizing.best_hisparse_batch, as
    `decode-server plan` reports it), capped by `host_pool_cap`. Where the cap binds, the run holds fewer
    requests than the device would: `device_bound_batch` records how many it would hold."""
    geometry = CacheGeometry.from_model_config(model_config)
    rules = kv_sizing.SizingRules(
        page_size=args.page_size, max_running_requests=batch_cap, chunked_prefill_size=max(2048, args.page_size),
        hisparse=HiSparseConfig(device_buffer_size=args.buffer_size, num_recent_slots=args.num_recent))
    ps = args.page_size
    host_per_request = kv_sizing.pages_for(max_len, ps) * ps * geometry.row_bytes(kv_dtype) * geometry.num_layers
    top_k = int(model_config.index_topk)
    device_bound, host_needed = kv_sizing.best_hisparse_batch(device_budget, geometry, kv_dtype, top_k, rules,
                                                              max_len, max_len, host_per_request)
    if device_bound < 1:
        raise ValueError(f"context {context}: the device budget does not hold one HiSparse request")
    cap, cap_source = host_pool_cap(args)
    host = min(host_needed, cap)
    layout = kv_sizing.hisparse_layout(device_budget, host, geometry, kv_dtype, top_k, max_len, rules)
    info = {"device_bound_batch": device_bound, "host_pool_for_device_batch_bytes": host_needed,
            "host_pool_cap_bytes": cap, "host_pool_cap_source": cap_source, "host_binds": host_needed > cap,
            "host_bytes_per_request": host_per_request}
    return layout, info


def fixed_hisparse_layout(args, model_config, kv_dtype, context: int, max_len: int, batch_cap: int,
                          device_budget: int) -> HiSparseLayout:
    """Size the pools for requests of `max_len` tokens: as many (buffer + indexer keys) as the device budget
    holds, capped by what the host budget holds."""
    geometry = CacheGeometry.from_model_config(model_config)  # GLM-5 shared layers own no indexer keys
    num_layers = geometry.num_layers
    top_k = int(model_config.index_topk)
    D = args.buffer_size or 2 * top_k
    rb = geometry.row_bytes(kv_dtype)
    ps = args.page_size
    pages = math.ceil(max_len / ps)
    index_bytes = geometry.index_key_bytes * geometry.num_index_layers
    per_req_device = (D + args.num_recent) * rb * num_layers + pages * ps * index_bytes
    per_req_host = pages * ps * rb * num_layers
    n = min(batch_cap, device_budget // per_req_device,
            int(args.host_kv_budget_gib * GIB) // per_req_host)
    if n < 1:
        raise ValueError(f"context {context}: the budgets do not hold one HiSparse request")
    return HiSparseLayout(num_layers=num_layers, top_k=top_k, buffer_size=D, num_recent=args.num_recent,
                          num_buffers=n, host_pages=n * pages, indexer_pages=n * pages, page_size=ps, row_bytes=rb,
                          max_reqs=n, max_ctx=max_len, geometry=geometry)


def build_engine(args, model, model_config, mode: str, context: int, max_len: int, batch_cap: int,
                 device_budget: int, parallel=None) -> tuple[Engine, dict]:  # fmt: skip
    """The engine of one run with `device_budget` bytes of device KV, and how its HiSparse pools were sized."""
    device = rank_device(args, parallel)
    hisparse = mode.startswith("hisparse")
    prefetch = PREFETCH_SUFFIX in mode
    early = EARLY_SUFFIX in mode
    speculative = SPECULATIVE_SUFFIX in mode
    cfg = EngineConfig(
        device=args.device, enable_hisparse=hisparse, page_size=args.page_size, context_length=max_len,
        kv_cache_dtype=args.kv_cache_dtype, attention_backend=args.attention_backend,
        device_kv_budget_bytes=device_budget,
        host_kv_budget_bytes=int(args.host_kv_budget_gib * GIB) if args.host_kv_budget_gib is not None else None,
        max_running_requests=batch_cap,
        max_queued_requests=batch_cap + 1, chunked_prefill_size=max(2048, args.page_size),
        hisparse=HiSparseConfig(device_buffer_size=args.buffer_size, num_recent_slots=args.num_recent,
                                prefetch_shared_layers=prefetch, early_swap_in=early,
                                side_stream_copy_blocks=side_copy_blocks(mode), speculative_prefetch=speculative),
        enable_deterministic_inference=args.enable_deterministic_inference, tp_size=args.tp_size,
        ep_size=args.ep_size, dp_size=args.dp_size, enable_dp_attention=args.enable_dp_attention,
        disable_cuda_graph=True,  # captured by run_one once the requests are in (capture_graphs)
        disable_overlap_schedule=args.disable_overlap_schedule,
    )
    kv = None
    sizing: dict = {}
    if hisparse:
        kv_dtype = resolve_kv_dtype(cfg, resolve_model_dtype(cfg, device))
        layout, sizing = hisparse_layout(args, model_config, kv_dtype, context, max_len, batch_cap, device_budget)
        shared = None if args.enable_dp_attention else parallel  # TP: one shared host pool; DP: one per rank
        kv = HiSparseCoordinator(layout, kv_dtype, device, parallel=shared,
                                 prefetch_shared_layers=prefetch, early_swap_in=early,
                                 side_stream_copy_blocks=side_copy_blocks(mode), speculative_prefetch=speculative)
        cfg = cfg.model_copy(update={"max_running_requests": layout.max_reqs})
    engine = Engine(cfg, model=model, model_config=model_config, tokenizer=None, kv_manager=kv, parallel=parallel)
    return engine, sizing


def overlap_label(args, device: torch.device) -> str:
    """Whether the engine's step loop overlaps host and device (engine.resolve_overlap_schedule)."""
    cfg = EngineConfig(device=device.type, disable_overlap_schedule=args.disable_overlap_schedule)
    return "on" if resolve_overlap_schedule(cfg, device) else "off"


def rank_device(args, parallel) -> torch.device:
    device = torch.device(args.device)
    if parallel is not None and device.type == "cuda":
        return torch.device("cuda", parallel.tp_rank)
    return device


def shmem_bytes() -> int:
    """The node's shared memory in use (`Shmem` of /proc/meminfo: tmpfs pages, the TP host pool among them)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    return 0


class SyntheticKV:
    """One random context (MLA rows, encoded for the KV dtype, and indexer keys) copied into every request.

    HiSparse host rows are written by the row-copy kernel from a device copy of the context when the run is on a
    GPU (the host pool is pinned, written through its UVA address at PCIe speed): a CPU `index_copy_` of 656-byte
    rows runs at ~1 GB/s, which made filling a 40 GiB host pool take most of a bench run's device time. The first
    request's rows are read back and compared, so a wrong fill cannot pass unnoticed."""

    def __init__(self, context: int, kv_dtype: torch.dtype, device: torch.device, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        rows = torch.randn(context, 576, generator=gen) * 0.5
        self.rows = encode_row_bytes(rows, kv_dtype)  # [context, row bytes] uint8, as the host pool holds them
        self.rows_src = self.rows.to(device)  # what the host pool is filled from (a GPU copy on GPU runs)
        self.positions = torch.arange(context, device=device)
        keys, self.scales = quantize_index_keys(torch.randn(context, 128, generator=gen))
        self.keys = keys
        self.rows_dev = encode_rows(rows, kv_dtype).to(device)  # as the dense pool holds them
        self.keys_dev, self.scales_dev = keys.to(device), self.scales.to(device)
        self.checked = False

    def inject(self, engine: Engine, req: Request, context: int) -> None:
        """The request's first `context` positions (at most the synthetic context's) into its pools."""
        kv = engine.kv
        row = req.row
        if isinstance(kv, HiSparseCoordinator):
            pool = kv.host.kv  # [L, N, row bytes]
            host_rows = kv.host.rows.slots(row, context).long().to(self.positions.device)
            copy_rows(self.rows_src.expand(pool.shape[0], -1, -1), pool, self.positions[:context], host_rows)
            if not self.checked:
                self._check_host_rows(pool, host_rows)
            idx_rows = kv.indexer.rows.slots(row, context).long()
            for layer in range(kv.indexer.keys.shape[0]):  # layers that own indexer keys
                kv.indexer.keys[layer, idx_rows] = self.keys_dev[:context]
                kv.indexer.scales[layer, idx_rows] = self.scales_dev[:context]
        else:
            cache = kv.cache
            slots = cache.tokens.slots(row, context).long()
            for layer in range(cache.num_layers):
                cache.kv[layer, slots] = self.rows_dev[:context]
            for layer in range(cache.index_keys.shape[0]):  # layers that own indexer keys
                cache.index_keys[layer, slots] = self.keys_dev[:context]
                cache.index_scales[layer, slots] = self.scales_dev[:context]

    def _check_host_rows(self, pool: torch.Tensor, host_rows: torch.Tensor) -> None:
        if self.positions.device.type == "cuda":
            torch.cuda.synchronize(self.positions.device)
        rows = host_rows.cpu()
        for layer in {0, pool.shape[0] - 1}:
            if not torch.equal(pool[layer].index_select(0, rows), self.rows[: len(rows)]):
                raise RuntimeError(f"host pool layer {layer} does not hold the injected rows")
        self.checked = True


def request_contexts(context: int, count: int, mixed: bool, seed: int) -> list[int]:
    """The context of each of `count` requests: all `context`, or (--mixed-contexts) uniform in
    [context / 8, context], seeded, as the lengths of a serving batch differ."""
    if not mixed:
        return [context] * count
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(max(1, context // 8), context + 1, (count,), generator=gen).tolist()


def penalized_sampling(vocab: int, seed: int) -> dict:
    """`--sampling penalized`: every edit that keeps counts, and a bias, on every request."""
    gen = torch.Generator().manual_seed(seed)
    bias = {int(t): 1.0 for t in torch.randperm(vocab, generator=gen)[:16]}
    return {"frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.1, "logit_bias": bias}


def fill(engine: Engine, synthetic: SyntheticKV, context: int, max_len: int, limit: int, seed: int,
         mixed: bool = False, sampling: str = "greedy") -> list[int]:
    """Admit requests with injected KV until the budget (or `limit`) is reached; returns the contexts of the
    admitted requests (the batch size is their count). `mixed`: each request's context from `request_contexts`
    (every request still reserves `max_len`, so the batch is the one equal contexts get).

    Every request shares the synthetic context but decodes from a token of its own: with one shared token every
    request would carry the same hidden state through every layer, so the router would send the whole batch to
    the same top-k experts and a MoE layer would read only those experts' weights (a fraction of what a real batch
    reads; measured so before 2026-11-26)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = int(engine.model_config.vocab_size)
    prompt = torch.randint(2, vocab, (context,), generator=gen).tolist()
    first_tokens = torch.randint(2, vocab, (max(limit, 1),), generator=gen).tolist()
    contexts = request_contexts(context, max(limit, 1), mixed, seed)
    edits = penalized_sampling(vocab, seed) if sampling == "penalized" else {}
    sched = engine.scheduler
    n = 0
    while n < limit:
        rid, length = f"b{n}", contexts[n]
        params = SamplingParams(max_tokens=max_len - length, temperature=0.0, ignore_eos=True, **edits)
        engine.add_request(rid, prompt[:length], params)
        req = engine._requests[rid]
        if not sched.try_admit(req) or not engine.kv.ensure_room(req.row, max_len):
            engine.abort_request(rid)
            break
        synthetic.inject(engine, req, length)
        req.num_computed = length
        sched.on_prefill_done(req)
        req.output_ids.append(int(first_tokens[n]))
        n += 1
    engine.step()  # returns the abort delta, if any, and runs the first decode step
    return contexts[:n]


class SpanTimer:
    """Accumulates the time of calls to wrapped functions while enabled: CUDA events on the current stream
    (no sync per call; includes GPU idle gaps inside the span) on GPU, wall time on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.enabled = False
        self.spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.cpu_seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            if not self.enabled:
                return fn(*args, **kwargs)
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(*args, **kwargs)
                end.record()
                self.spans.append((start, end))
                return out
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            self.cpu_seconds += time.perf_counter() - t
            return out

        return timed

    def total_ms(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return sum(s.elapsed_time(e) for s, e in self.spans)
        return 1000 * self.cpu_seconds


class StepBreakdown:
    """Where a decode step's time goes: forward, indexer top-k, attention (incl. swap-in), swap-in alone."""

    def __init__(self, engine: Engine) -> None:
        self.timers = {name: SpanTimer(engine.device) for name in ("forward", "indexer", "attention", "swap_in")}
        backend = engine.kv.backend
        engine._forward = self.timers["forward"].wrap(engine._forward)
        backend.index_topk = self.timers["indexer"].wrap(backend.index_topk)
        backend.sparse_attention = self.timers["attention"].wrap(backend.sparse_attention)
        self._swaps: list = getattr(backend, "swaps", [])  # HiSparse: one bound swap-in per layer; dense: none
        self._unwrapped_swaps = list(self._swaps)
        self._swaps[:] = [self.timers["swap_in"].wrap(swap) for swap in self._unwrapped_swaps]

    def enable(self) -> None:
        for t in self.timers.values():
            t.enabled = True

    def close(self) -> None:
        self._swaps[:] = self._unwrapped_swaps

    def per_step_ms(self, steps: int) -> dict[str, float]:
        return {f"{name}_ms": t.total_ms() / steps for name, t in self.timers.items()}


def layer_totals(engine: Engine) -> tuple[int, int, int, int]:
    stats = engine.stats()
    return stats.hisparse_hits, stats.hisparse_misses, stats.bytes_h2d, stats.bytes_d2h


def speculative_rows(engine: Engine) -> tuple[int, int, int | None]:
    """Rows the speculative prefetch's bets copied so far, all layers (HiSparseLayerStats.speculative_misses); the
    part of them copied into the layers whose payoff is measured; and the rows the bets saved those layers, the
    full layers with shared followers (`speculative_rows_saved`: the followers' misses − the full layers' own;
    None without bets or without shared layers, where there is no counterfactual).

    Why the middle figure: a bet-on full layer without a follower (GLM-5's last layer, 77) copies rows whose payoff
    nothing measures, so saved / all copied understates the payoff (19 of GLM-5's 20 bet-on layers are measured);
    saved / measured copied is the ratio an operator reads per layer off /metrics."""
    layers = engine.stats().hisparse_layers
    measured = [layer for layer in layers if layer.speculative_rows_saved is not None]
    return (sum(layer.speculative_misses for layer in layers), sum(layer.speculative_misses for layer in measured),
            sum(layer.speculative_rows_saved for layer in measured) if measured else None)


def capture_graphs(args, engine: Engine, batch: int) -> dict:
    """CUDA graphs for the timed steps (after the synthetic top-k is installed, so they capture it): the bucket
    this batch runs in, or every bucket with --cuda-graph-all-buckets; capture time and device memory."""
    config = engine.config.model_copy(update={"disable_cuda_graph": args.disable_cuda_graph})
    reason = graphs_off_reason(config, engine.device, engine.model_dtype, engine.kv.backend)
    if reason is not None:
        return {"cuda_graph": False, "cuda_graph_off_reason": reason}
    buckets = resolve_batch_sizes(None, None, min(config.max_running_requests, engine.kv.backend.scratch_row))
    dp = (engine.parallel.dp_rank, engine.parallel.dp_size) if engine.dp_attention else None
    runner = DecodeGraphRunner(engine.model, engine.kv.backend, engine.device, buckets, engine.context_length, dp=dp)
    bucket = bucket_for(batch, buckets)  # DP: every rank's batch is this one (same budget), so the agreed bucket
    with torch.inference_mode():
        runner.capture(None if args.cuda_graph_all_buckets else [bucket] if bucket is not None else [])
    engine.graph_runner = runner
    return {"cuda_graph": True, "graph_bucket": bucket, "graphs_captured": len(runner.captured),
            "graph_capture_s": runner.capture_seconds, "graph_capture_mib": runner.capture_bytes / 2**20}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Roof:
    """The model's weight bytes and the bandwidths measured in this process, for each run's roofline floor
    (benchmarks/roofline.py): (weights read + KV and indexer keys read) / HBM + misses (h2d bytes) / PCIe."""

    def __init__(self, model, device: torch.device) -> None:
        self.weights_bytes = weight_bytes(model)["total"]
        self.split = roofline.weight_split(model)
        self.bandwidths = roofline.measure_bandwidths(device)

    def to_json(self) -> dict:
        return {"weights_bytes": self.weights_bytes, "weights_gib": self.weights_bytes / GIB,
                "weight_split": self.split.to_json(), **self.bandwidths}

    def floor_fields(self, engine: Engine, model_config, batch: int, context: int, miss_bytes: float,
                     step_ms: float) -> dict:
        geometry = CacheGeometry.from_model_config(model_config)
        kv = roofline.kv_bytes_read(batch, context, geometry.num_layers, geometry.num_index_layers,
                                    int(model_config.index_topk), geometry.row_bytes(engine.kv_dtype),
                                    geometry.index_key_bytes)
        floor = roofline.step_floor(roofline.weight_bytes_read(self.split, batch), kv, miss_bytes,
                                    float(self.bandwidths["hbm_gbps"]), float(self.bandwidths["pcie_gbps"]))
        return {"weights_gib": self.weights_bytes / GIB, "floor_ms": 1000 * floor.seconds,
                "floor_hbm_ms": 1000 * floor.hbm_s, "floor_pcie_ms": 1000 * floor.pcie_s,
                "floor_weight_bytes": floor.weight_bytes, "floor_kv_bytes": floor.kv_bytes,
                "floor_miss_bytes": floor.miss_bytes,
                "step_over_floor": step_ms / (1000 * floor.seconds) if floor.seconds > 0 else None}


def reduced_layers(config, num_layers: int):
    """The config's first `num_layers` layers (dense / MoE and full / shared indexer kinds kept): a shorter model
    with the same per-layer shapes, e.g. for a budget sweep at GiB per layer that the whole model's memory leaves
    no room for."""
    if not 1 <= num_layers <= config.num_hidden_layers:
        raise ValueError(f"--num-layers {num_layers} must be in [1, {config.num_hidden_layers}]")
    reduced = dataclasses.replace(
        config, num_hidden_layers=num_layers, indexer_types=config.indexer_types[:num_layers],
        mlp_layer_types=config.mlp_layer_types[:num_layers])
    reduced.validate()
    return reduced


def planned_budget(args, device: torch.device) -> int:
    """The device KV budget the engine would measure now (decode_server/engine/memory.py `device_kv_budget`): on
    CUDA the free memory with the model built, minus (1 - mem_fraction_static) of the device, which is left for
    activations, CUDA graphs and per-request tables; on the CPU the engine's fixed CPU budget. Measured once, so
    dense and HiSparse runs get the same device memory."""
    config = EngineConfig(device=device.type, mem_fraction_static=args.mem_fraction_static)
    return device_kv_budget(config, device)


def host_mem_total() -> int | None:
    """MemTotal of /proc/meminfo (the host memory the pinned pool competes for), else None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


PREFETCH_SUFFIX = "+pf"  # HiSparse modes run with prefetch_shared_layers
EARLY_SUFFIX = "+early"  # HiSparse modes run with early_swap_in
SPECULATIVE_SUFFIX = "+spec"  # HiSparse modes run with speculative_prefetch
COPY_BLOCKS_SUFFIX = "+cb"  # +cbN: side-stream swap-ins' copy kernel capped at N blocks


def hisparse_variants(args, mode: str, has_shared_layers: bool) -> list[str]:
    """The mode names one planned run of `mode` expands to: HiSparse without and/or with the shared-layer
    prefetch (--hisparse-prefetch-shared-layers) on models with GLM-5 shared layers (elsewhere it has nothing to
    do, so it is left off), each with and/or without the early swap-in (--hisparse-early-swap-in); other modes as
    they are."""
    if mode != "hisparse":
        return [mode]
    pf = {"off": [""], "on": [PREFETCH_SUFFIX], "both": ["", PREFETCH_SUFFIX]}[args.hisparse_prefetch_shared_layers]
    early = {"off": [""], "on": [EARLY_SUFFIX], "both": ["", EARLY_SUFFIX]}[args.hisparse_early_swap_in]
    spec = {"off": [""], "on": [SPECULATIVE_SUFFIX], "both": ["", SPECULATIVE_SUFFIX]}[
        getattr(args, "hisparse_speculative_prefetch", "off")]
    variants = [mode + p + e + b for p in (pf if has_shared_layers else [""]) for e in early for b in spec]
    caps = getattr(args, "hisparse_side_copy_blocks", None)
    if not caps:
        return variants
    # Only variants with side-stream swap-ins have a copy grid to cap.
    on_side = [EARLY_SUFFIX in v or PREFETCH_SUFFIX in v or SPECULATIVE_SUFFIX in v for v in variants]
    return [v + f"{COPY_BLOCKS_SUFFIX}{n}" if side else v
            for v, side in zip(variants, on_side, strict=True) for n in (caps if side else [None])]


def copy_blocks_arg(text: str) -> int | str:
    """A --hisparse-side-copy-blocks value: a block count >= 0 or "auto"."""
    if text == "auto":
        return text
    try:
        blocks = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a block count or auto, got {text!r}") from None
    if blocks < 0:
        raise argparse.ArgumentTypeError(f"a block count must be >= 0, got {blocks}")
    return blocks


def side_copy_blocks(mode: str) -> int | str:
    """The side-stream copy cap of a mode (its `+cbN` or `+cbauto` suffix), else the config's default."""
    found = re.search(re.escape(COPY_BLOCKS_SUFFIX) + r"(\d+|auto)", mode)
    if not found:
        return HiSparseConfig().side_stream_copy_blocks
    return found.group(1) if found.group(1) == "auto" else int(found.group(1))


PER_QUERY_SUFFIX = "+pq"  # the indexer's scores by the per-query kernel (--indexer-split)


def split_variants(args) -> list[str]:
    """The suffixes of one run per --indexer-split choice: none for the balanced split (the default), `+pq` for
    the per-query kernel."""
    return {"balanced": [""], "per-query": [PER_QUERY_SUFFIX], "both": ["", PER_QUERY_SUFFIX]}[
        getattr(args, "indexer_split", "balanced")]


def scores_config(mode: str) -> indexer_fast.FastScoresConfig:
    """The indexer scores kernel's config for a run of `mode`: the per-query kernel for `+pq` modes."""
    return indexer_fast.FastScoresConfig(balanced=PER_QUERY_SUFFIX not in mode)


OVERLAP_SUFFIX = "@ov"  # @ovP: the synthetic selections share P % across layers (--cross-layer-overlap)


def overlap_variants(args, miss_rate: float | None) -> list[str]:
    """The suffixes of one synthetic run per --cross-layer-overlap value (none for the default single 0, for runs on
    the model's own selection, which the overlap does not touch, nor at 0 % misses, where nothing enters)."""
    values = getattr(args, "cross_layer_overlap", [0.0])
    if not miss_rate or values == [0.0]:
        return [""]
    return [f"{OVERLAP_SUFFIX}{round(100 * c)}" for c in values]


def cross_layer_overlap(mode: str) -> float:
    """The synthetic selections' cross-layer overlap of a mode (its `@ovP` suffix), else 0."""
    found = re.search(re.escape(OVERLAP_SUFFIX) + r"(\d+)", mode)
    return int(found.group(1)) / 100 if found else 0.0


def run_name(mode: str, miss_rate: float | None) -> str:
    """The result's mode: `hisparse-mX` (or `dense-mX`, --dense-synthetic-topk) for a synthetic selection of miss
    rate X, the variant suffixes kept."""
    if miss_rate is None:
        return mode
    base = "dense" if mode.startswith("dense") else "hisparse"
    return f"{base}-m{round(miss_rate * 100)}" + mode.removeprefix(base)


def prefetch_launched(engine: Engine) -> int | None:
    """Shared-layer swap-ins the HiSparse backend started at their full layer (warm-up steps included); None for
    dense."""
    prefetch = getattr(getattr(engine.kv, "backend", None), "prefetch", None)
    return prefetch.launched if prefetch is not None else None


def run_one(args, model, model_config, mode: str, context: int, miss_rate: float | None,
            fixed_batch: int | None, parallel=None, device_budget: int | None = None, roof: Roof | None = None,
            sweep: float | None = None) -> dict:
    """One timed run: `mode` at `context` with as many requests as `device_budget` holds (or `fixed_batch`).
    Its engine is gone when this returns, and its host pool's pages released: the next run sizes its pool from
    the host's free memory. (Released inside the run, the pool outlived it: locals such as the step breakdown
    still held the engine, and each run's pool was capped by the previous one's, 2026-11-26.)"""
    default_scores = indexer_fast.DEFAULT_CONFIG
    indexer_fast.DEFAULT_CONFIG = scores_config(mode)  # read at every call, so before the graphs are captured
    try:
        result = _timed_run(args, model, model_config, mode, context, miss_rate, fixed_batch, parallel,
                            device_budget, roof, sweep)
    finally:
        indexer_fast.DEFAULT_CONFIG = default_scores
    gc.collect()
    if rank_device(args, parallel).type == "cuda":
        torch.cuda.empty_cache()
        pinned.release_unused()
    return result


def _timed_run(args, model, model_config, mode: str, context: int, miss_rate: float | None,
               fixed_batch: int | None, parallel, device_budget: int | None, roof: Roof | None,
               sweep: float | None) -> dict:
    device = rank_device(args, parallel)
    device_budget = device_budget if device_budget is not None else int(args.device_kv_budget_gib * GIB)
    max_len = context + args.warmup + args.steps + 4  # room for every step; nothing finishes while timed
    cap = fixed_batch or args.max_batch
    shmem_before = shmem_bytes()
    t_build = time.perf_counter()
    engine, sizing = build_engine(args, model, model_config, mode, context, max_len, cap, device_budget, parallel)
    build_s = time.perf_counter() - t_build
    kv_dtype = engine.kv_dtype
    name = run_name(mode, miss_rate)
    synthetic = SyntheticKV(context, kv_dtype, device, args.seed)
    t_fill = time.perf_counter()
    contexts = fill(engine, synthetic, context, max_len, cap, args.seed, getattr(args, "mixed_contexts", False),
                    getattr(args, "sampling", "greedy"))
    batch = len(contexts)
    mean_context = round(sum(contexts) / batch) if batch else context
    sync(device)
    fill_s = time.perf_counter() - t_fill
    host_pool = getattr(getattr(engine.kv, "host", None), "nbytes", 0)
    if parallel is not None:
        import torch.distributed as dist

        dist.barrier(group=parallel.cpu_group)  # every rank has written its (identical) rows
    shmem_used = shmem_bytes() - shmem_before
    if fixed_batch is not None and batch < fixed_batch:
        raise RuntimeError(f"{name} at {context}: only {batch} of {fixed_batch} requests fit")
    if miss_rate is not None:
        # --mixed-contexts: each request's window slides over its own context (its request row → its length).
        rows = ({engine._requests[f"b{i}"].row: length for i, length in enumerate(contexts)}
                if getattr(args, "mixed_contexts", False) else None)
        SyntheticTopK(engine, context, miss_rate, args.seed, cross_layer_overlap(mode), row_contexts=rows)
    graphs = capture_graphs(args, engine, batch)
    breakdown = StepBreakdown(engine)
    try:
        for _ in range(args.warmup):
            engine.step()
        sync(device)
        h0, m0, up0, down0 = layer_totals(engine)
        b0, measured0, saved0 = speculative_rows(engine)
        t0 = time.perf_counter()
        for i in tqdm(range(args.steps), desc=f"{name} L={context} B={batch}", leave=False, file=sys.stderr):
            if i == 1:  # time the breakdown on all but the first timed step (events cost a little)
                breakdown.enable()
            deltas = engine.step()
            if any(d.finished for d in deltas):
                raise RuntimeError("a request finished during the timed steps (max_tokens too small)")
        sync(device)
        elapsed = time.perf_counter() - t0
        h1, m1, up1, down1 = layer_totals(engine)
        b1, measured1, saved1 = speculative_rows(engine)
        spans = breakdown.per_step_ms(max(1, args.steps - 1))
        if engine.graph_runner is not None and engine.graph_runner.num_replays:
            # Replayed steps call no Python per layer: only the whole forward is timed.
            spans.update(indexer_ms=None, attention_ms=None, swap_in_ms=None)
        graphs["graph_replays"] = engine.graph_runner.num_replays if engine.graph_runner is not None else 0
    finally:
        breakdown.close()
    if args.profile_dir:
        label = name + (f"_B{fixed_batch}" if fixed_batch else "") + (f"_rank{parallel.tp_rank}" if parallel else "")
        profile_steps(engine, device, Path(args.profile_dir) / f"profile_{label}_{context}.txt")
    selected = (h1 - h0) + (m1 - m0)
    result = {
        "mode": name, "context": context, "batch": batch, "fixed_batch": fixed_batch, "steps": args.steps,
        "step_ms": 1000 * elapsed / args.steps,
        # DP attention: every rank runs a batch of this size in each (lockstep) pass
        "tokens_per_s": batch * args.steps / elapsed * (args.dp_size if args.enable_dp_attention else 1),
        "dp_size": args.dp_size if args.enable_dp_attention else 1,
        "hit_rate": (h1 - h0) / selected if selected else None,
        "pcie_bytes_per_step": ((up1 - up0) + (down1 - down0)) / args.steps,
        "h2d_bytes_per_step": (up1 - up0) / args.steps, "d2h_bytes_per_step": (down1 - down0) / args.steps,
        "tp_size": args.tp_size, "host_pool_bytes": host_pool, "build_s": build_s, "fill_s": fill_s,
        "host_pool_shmem_bytes": shmem_used if parallel is not None and host_pool and not args.enable_dp_attention
        else None,
        "kv_budget_bytes": device_budget, "kv_budget_gib": device_budget / GIB, "kv_cache_dtype": str(kv_dtype),
        "sweep_kv_gib_per_layer": sweep, "prefetch_shared_layers": PREFETCH_SUFFIX in mode,
        "early_swap_in": EARLY_SUFFIX in mode, "side_stream_copy_blocks": side_copy_blocks(mode),
        "prefetch_launched": prefetch_launched(engine), "speculative_prefetch": SPECULATIVE_SUFFIX in mode,
        "cross_layer_overlap": cross_layer_overlap(mode) if miss_rate is not None else None,
        "speculative_rows_per_step": (b1 - b0) / args.steps,
        "speculative_rows_measured_per_step": (measured1 - measured0) / args.steps if saved1 is not None else None,
        "speculative_rows_saved_per_step": (saved1 - saved0) / args.steps if saved1 is not None else None,
        "mixed_contexts": getattr(args, "mixed_contexts", False), "mean_context": mean_context,
        "indexer_scores": "per-query" if PER_QUERY_SUFFIX in mode else "balanced", **sizing, **spans, **graphs,
    }
    if roof is not None:  # the KV bytes of a step grow linearly with the context: the mean gives their sum
        result.update(roof.floor_fields(engine, model_config, batch, mean_context, result["h2d_bytes_per_step"],
                                        result["step_ms"]))
    return result


def profile_steps(engine: Engine, device: torch.device, path: Path, steps: int = 2) -> None:
    """Where host and device time go in a decode step: operator tables from torch.profiler, and on CUDA its
    Chrome trace next to them (`<path stem>.trace.json`, for Perfetto): which kernels run beside which, e.g. the
    early swap-in's side stream against the projections."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync(device)
    averages = prof.key_averages()
    tables = [f"# {steps} decode steps\n", "## by self CPU time\n",
              averages.table(sort_by="self_cpu_time_total", row_limit=30)]
    if device.type == "cuda":
        tables += ["\n## by device time\n", averages.table(sort_by="self_cuda_time_total", row_limit=30)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(tables))
    if device.type == "cuda":
        prof.export_chrome_trace(str(path.with_suffix(".trace.json")))


def write_plots(results: list[dict], path: Path) -> list[Path]:
    """tok/s against context (`path`) and, with a budget sweep, HiSparse / dense tok/s against the budget per
    layer (`<path stem>_sweep.png`); none where matplotlib is missing (the JSON holds every figure)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        logger.warning("matplotlib is not installed: no plots (pip install '.[bench]')")
        return []
    main = [r for r in results if r.get("sweep_kv_gib_per_layer") is None]
    written = []
    if main:
        plot(main, path)
        written.append(path)
    sweep = [r for r in results if r.get("sweep_kv_gib_per_layer") is not None]
    ratios = sweep_ratios(sweep)
    if ratios:
        sweep_path = path.with_name(path.stem + "_sweep.png")
        plot_sweep(ratios, sweep_path)
        written.append(sweep_path)
    return written


def sweep_ratios(sweep: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """HiSparse mode → [(KV GiB per layer, its tok/s / dense tok/s at that budget)], budgets where both ran."""
    dense = {r["sweep_kv_gib_per_layer"]: r["tokens_per_s"] for r in sweep if r["mode"] == "dense"}
    out: dict[str, list[tuple[float, float]]] = {}
    for r in sweep:
        per_layer = r["sweep_kv_gib_per_layer"]
        if r["mode"] != "dense" and per_layer in dense:
            out.setdefault(r["mode"], []).append((per_layer, r["tokens_per_s"] / dense[per_layer]))
    return {mode: sorted(points) for mode, points in out.items()}


def plot_sweep(ratios: dict[str, list[tuple[float, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, points in ratios.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{mode} / dense")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("device KV budget per layer (GiB)")
    ax.set_ylabel("tokens/s ratio")
    ax.set_title("HiSparse / dense against the KV budget per layer")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in dict.fromkeys(r["mode"] for r in results):
        pts = sorted((r["context"], r["tokens_per_s"]) for r in results if r["mode"] == mode and not r["fixed_batch"])
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode tokens/s (budget filled)")
    ax.set_title("Decode throughput under the same device KV budget")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)  # this script's progress lines; the server's INFO logs stay off
    args = parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tp_size > 1:
        return launch_ranks(args)
    return run_rank(args)


def launch_ranks(args) -> int:
    """One process per rank (torch.multiprocessing, spawn); rank 0 reports. Non-zero if any rank fails."""
    import torch.multiprocessing as mp

    from decode_server.runtime.rank_group import free_tcp_port

    if args.device == "cuda" and torch.cuda.device_count() < args.tp_size:
        raise SystemExit(f"--tp-size {args.tp_size} needs {args.tp_size} GPUs; {torch.cuda.device_count()} visible")
    init_method = f"tcp://127.0.0.1:{free_tcp_port()}"
    try:
        mp.spawn(_rank_entry, args=(args, init_method), nprocs=args.tp_size, join=True)
    except mp.ProcessRaisedException as exc:
        logger.error("a rank failed: %s", exc)
        return 1
    except mp.ProcessExitedException as exc:
        return 1 if exc.exit_code else 0
    return 0


def _rank_entry(rank: int, args, init_method: str) -> None:
    from decode_server.runtime.rank_group import init_rank

    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s rank {rank} %(name)s: %(message)s")
    config = EngineConfig(device=args.device, tp_size=args.tp_size, ep_size=args.ep_size, dp_size=args.dp_size,
                          enable_dp_attention=args.enable_dp_attention)
    parallel = init_rank(config, rank, init_method)
    code = run_rank(args, parallel)
    if code:
        sys.exit(code)


def describe_device(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def write_results(args, device: torch.device, results: list[dict]) -> Path:
    """The JSON of every run so far: written after each run too, so a run cut short (a timeout on a lent GPU)
    keeps what finished."""
    device_name = describe_device(device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "device": device_name,
            "attention_kernel": resolve_attention_kernel(args.attention_backend, device,
                                                         args.enable_deterministic_inference),
            "overlap_schedule": overlap_label(args, device), "command": " ".join(sys.argv), "args": vars(args)}
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return out


def _ms(value: float | None) -> str:
    return f"{value:>9.2f}" if value is not None else f"{'-':>9}"


def run_rank(args, parallel=None) -> int:
    """The whole benchmark on one rank (every rank runs it; only rank 0, or a single process, reports)."""
    device = rank_device(args, parallel)
    reporting = parallel is None or parallel.tp_rank == 0
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_config = load_config(args.config)
    if args.num_layers is not None:
        model_config = reduced_layers(model_config, args.num_layers)
    t_model = time.perf_counter()
    model = build_random_model(model_config, device, dtype, seed=args.seed, parallel=parallel,  # TP: this shard
                               quantization=args.quantization)
    sync(device)
    args.model_build_s = time.perf_counter() - t_model
    roof = Roof(model, device)
    args.roof = roof.to_json()
    budget = planned_budget(args, device) if args.plan_memory else int(args.device_kv_budget_gib * GIB)
    args.kv_budget_bytes = budget
    args.host_memory = {"mem_total_bytes": host_mem_total(), "mem_available_bytes": available_host_memory()}
    if reporting:
        logger.info("model built in %.1f s: weights %.2f GiB; HBM %.0f GB/s, PCIe %.1f GB/s (%s / %s); device KV "
                    "budget %.2f GiB (%s)", args.model_build_s, roof.weights_bytes / GIB, roof.bandwidths["hbm_gbps"],
                    roof.bandwidths["pcie_gbps"], roof.bandwidths["hbm_method"], roof.bandwidths["pcie_method"],
                    budget / GIB, "planned" if args.plan_memory else "fixed")
    runs: list[tuple[str, float | None, int | None]] = [
        (m, None, None) for m in args.modes if not (m == "hisparse" and args.skip_model_indexer_run)]
    if "hisparse" in args.modes:
        runs += [("hisparse", r, None) for r in args.miss_rates]
    if "dense" in args.modes and args.dense_synthetic_topk:
        runs += [("dense", r, None) for r in args.miss_rates]
    # With --batch-miss-rates the fixed batches run HiSparse on those synthetic rates only (not on the model's own
    # random-weight indexer, whose ~87 % misses say nothing about a fixed miss rate).
    runs += [(m, None, b) for b in args.batch_sizes for m in args.modes
             if not (m == "hisparse" and args.batch_miss_rates)]
    if "hisparse" in args.modes:
        runs += [("hisparse", r, b) for b in args.batch_sizes for r in args.batch_miss_rates]
    if "dense" in args.modes and args.dense_synthetic_topk:  # dense over the same synthetic selection
        runs += [("dense", r, b) for b in args.batch_sizes for r in args.batch_miss_rates]
    has_shared_layers = bool(shared_followers(CacheGeometry.from_model_config(model_config)))
    plan: list[tuple[int, str, float | None, int | None, int, float | None]] = [
        (context, mode, miss, fixed, budget, None) for context in args.contexts for mode, miss, fixed in runs]
    for per_layer in args.sweep_kv_gib_per_layer:
        sweep_budget = int(per_layer * model_config.num_hidden_layers * GIB)
        plan += [(args.sweep_context, mode, miss, None, sweep_budget, per_layer) for mode, miss in
                 [("dense", None)] * ("dense" in args.modes)
                 + [("hisparse", r) for r in args.sweep_miss_rates] * ("hisparse" in args.modes)]
    plan = [(context, variant + split + overlap, miss, fixed, run_budget, sweep)
            for context, mode, miss, fixed, run_budget, sweep in plan
            for variant in hisparse_variants(args, mode, has_shared_layers) for overlap in overlap_variants(args, miss)
            for split in split_variants(args)]
    results = []
    for context, mode, miss, fixed, run_budget, sweep in plan:
        try:
            if run_budget > budget:
                raise ValueError(f"sweep budget {run_budget / GIB:.2f} GiB exceeds the "
                                 f"{'planned' if args.plan_memory else 'fixed'} {budget / GIB:.2f} GiB "
                                 "(fewer --num-layers make room)")
            results.append(run_one(args, model, model_config, mode, context, miss, fixed, parallel,
                                   device_budget=run_budget, roof=roof, sweep=sweep))
        except (ValueError, RuntimeError, torch.OutOfMemoryError, DecodeServerError) as exc:
            logger.warning("skipped %s (miss %s, batch %s) at context %d: %s", mode, miss, fixed, context, exc)
            results.append({"mode": run_name(mode, miss),
                            "context": context, "fixed_batch": fixed, "sweep_kv_gib_per_layer": sweep,
                            "error": str(exc)})
        if reporting:
            write_results(args, device, results)
            last = results[-1]
            if "error" not in last:
                logger.info("done: %s context %d batch %d: %.1f tok/s, %.2f ms a step (engine built in %.1f s,"
                            " KV filled in %.1f s)", last["mode"], last["context"], last["batch"],
                            last["tokens_per_s"], last["step_ms"], last["build_s"], last["fill_s"])
    ok = [r for r in results if "error" not in r]
    if not reporting:
        return 0 if ok else 1
    device_name = describe_device(device)

    def label_of(r: dict) -> str:
        return r["mode"] + (f"@B{r['fixed_batch']}" if r.get("fixed_batch") else "") + (
            f"@{r['sweep_kv_gib_per_layer']:g}G/L" if r.get("sweep_kv_gib_per_layer") is not None else "")

    width = max([18] + [len(label_of(r)) + 1 for r in results])  # variant names (+spec@ov80, +cbN) run long
    header = (f"{'mode':<{width}}{'context':>8}{'KV GiB':>8}{'batch':>7}{'tok/s':>11}{'step ms':>10}{'floor ms':>10}"
              f"{'step/floor':>11}{'hit rate':>10}{'PCIe MB/step':>14}{'fwd ms':>9}{'idx ms':>9}{'attn ms':>9}"
              f"{'swap ms':>9}")
    host = args.host_memory
    host_text = (f"host memory {host['mem_total_bytes'] / GIB:.1f} GiB total, {host['mem_available_bytes'] / GIB:.1f}"
                 " GiB available" if host["mem_total_bytes"] and host["mem_available_bytes"] else "host memory unknown")
    budget_text = (f"planned (mem_fraction_static {args.mem_fraction_static:g}): {args.kv_budget_bytes / GIB:.2f} GiB "
                   f"device, host pool sized for HiSparse's batch (cap: {'--host-kv-budget-gib ' + format(args.host_kv_budget_gib, 'g') + ' GiB, ' if args.host_kv_budget_gib is not None else ''}"
                   f"{args.host_memory_fraction:g} x MemAvailable)" if args.plan_memory else
                   f"{args.device_kv_budget_gib:g} GiB device, {args.host_kv_budget_gib:g} GiB host")
    print(f"device: {device_name}; config: {args.config}"
          + (f" (first {args.num_layers} layers)" if args.num_layers else "")
          + f"; weights {args.roof['weights_gib']:.2f} GiB ({args.quantization}, built in {args.model_build_s:.1f} s); "
          f"KV budget {budget_text}; {host_text}; HBM {args.roof['hbm_gbps']:.0f} GB/s, PCIe "
          f"{args.roof['pcie_gbps']:.1f} GB/s (copies in this process); tp_size {args.tp_size}"
          + (f", ep_size {args.ep_size}" if args.ep_size > 1 else "")
          + (f", DP attention over {args.dp_size} ranks (batch: per rank; tok/s: all ranks)"
             if args.enable_dp_attention else "") + f"; steps: {args.steps}; "
          f"KV {args.kv_cache_dtype}; attention "
          f"{resolve_attention_kernel(args.attention_backend, device, args.enable_deterministic_inference)}"
          + ("; deterministic inference" if args.enable_deterministic_inference else "")
          + f"; overlap schedule {overlap_label(args, device)}")
    print(header)
    for r in results:
        label = label_of(r)
        if "error" in r:
            print(f"{label:<{width}}{r['context']:>8}  error: {r['error']}")
            continue
        hit = f"{r['hit_rate']:.3f}" if r["hit_rate"] is not None else "-"
        ratio = f"{r['step_over_floor']:.2f}" if r.get("step_over_floor") is not None else "-"
        print(f"{label:<{width}}{r['context']:>8}{r['kv_budget_gib']:>8.3g}{r['batch']:>7}{r['tokens_per_s']:>11.1f}"
              f"{r['step_ms']:>10.2f}{_ms(r.get('floor_ms')):>10}{ratio:>11}{hit:>10}"
              f"{r['pcie_bytes_per_step'] / 1e6:>14.2f}{r['forward_ms']:>9.2f}{_ms(r['indexer_ms'])}"
              f"{_ms(r['attention_ms'])}{_ms(r['swap_in_ms'])}")
        if r.get("host_binds"):
            print(f"{'':<{width}}host pool binds: the device budget holds {r['device_bound_batch']} requests, whose rows "
                  f"need {r['host_pool_for_device_batch_bytes'] / GIB:.1f} GiB of host memory; capped at "
                  f"{r['host_pool_cap_bytes'] / GIB:.1f} GiB ({r['host_pool_cap_source']})")
        if r.get("speculative_prefetch"):
            saved = r.get("speculative_rows_saved_per_step")
            measured = r.get("speculative_rows_measured_per_step")
            print(f"{'':<14}bets: {r['speculative_rows_per_step']:.0f} rows copied a step"
                  + (f"; into the full layers with a shared follower {measured:.0f}, of which {saved:.0f} saved "
                     "their own swap-ins (their followers' misses - theirs)" if saved is not None else ""))
        if r.get("cuda_graph"):
            print(f"{'':<14}CUDA graph: bucket {r['graph_bucket']}, {r['graph_replays']} replays; captured "
                  f"{r['graphs_captured']} graph(s) in {r['graph_capture_s']:.2f} s, "
                  f"{r['graph_capture_mib']:.1f} MiB")
        else:
            print(f"{'':<14}no CUDA graph: {r.get('cuda_graph_off_reason')}")
        if r["host_pool_bytes"]:
            shm = r["host_pool_shmem_bytes"]
            copies = f"one per rank ({args.dp_size})" if args.enable_dp_attention else f"one copy for {args.tp_size} rank(s)"
            print(f"{'':<14}host pool {r['host_pool_bytes'] / GIB:.3f} GiB, {copies}"
                  + (f"; node shared memory taken: {shm / GIB:.3f} GiB" if shm is not None else ""))
    out = write_results(args, device, results)
    plots = write_plots(ok, Path(args.plot)) if ok else []
    print(f"wrote {out}" + (f" and {', '.join(map(str, plots))}" if plots else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
