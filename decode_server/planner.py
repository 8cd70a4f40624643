"""The memory planner behind `decode-server plan`: from a config.json (no weights) and the serve flags to what one
GPU holds — weights, KV budget, KV pools — and how many requests of a given context fit at once, dense and
HiSparse.

It computes what the engine would: the weights from the same module tree the engine builds, with the same choice
of FP8 projections (`build_empty_model`, `decode_server/model/quantization.py`), counted as the engine counts them
(`decode_server/model/weights.py`), the pools with the same sizing functions the engine calls
(`decode_server/engine/kv_sizing.py`), and the capacity with the scheduler's admission rule (a request needs pages
for its tokens and, in HiSparse mode, a device buffer). Only the budget on CUDA is modelled rather than measured:

    KV budget = kv_budget_from_memory(free, total, f)  with  free = total − weights − runtime memory
              = f × total − weights − runtime memory

which is the engine's rule (`decode_server/engine/memory.py`: free device memory after the model is loaded, minus
the (1 − f) share kept for activations, CUDA graphs, NCCL buffers and per-request tables). "Runtime memory" is what
else is in use when the engine measures: the CUDA context and the caching allocator's rounding; it is an estimate
(`--runtime-memory`, default 1 GiB) — the engine logs the real figure at start ("device memory when the KV pools
are sized": in use minus this process's tensors). docs/deploy.md "Planning memory" describes the model and shows it
for DeepSeek-V3.2 and GLM-5.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from decode_server.config import EngineConfig
from decode_server.engine import kv_sizing
from decode_server.engine.kernel_support import gpu_kernel_problems
from decode_server.engine.kv_rows import CacheGeometry, check_fp8_row_format, is_fp8
from decode_server.engine.memory import CPU_DEFAULT_DEVICE_BUDGET, resolve_kv_dtype, resolve_model_dtype
from decode_server.model.config import ModelConfig
from decode_server.model.quantization import Fp8LayoutError, checkpoint_block, resolve_quantization, wants_fp8
from decode_server.model.weights import WeightBytes, planned_weight_bytes

GIB = 1 << 30
# Total device memory as `nvidia-smi` and `torch.cuda.mem_get_info` report it (MiB), for `--device-memory NAME`:
# H100 SXM 80GB (81559 MiB = 85 520 809 984 B) and H200 (143771 MiB).
GPU_MEMORY = {"h100": 81559 << 20, "h200": 143771 << 20}
DEFAULT_RUNTIME_MEMORY = 1 << 30


def read_config_json(name_or_path: str) -> tuple[dict[str, Any], str]:
    """(config.json as a dict, where it came from): a name in configs/ (`tiny-dsa`, `deepseek-v3.2`, ...), a
    config JSON file, or a checkpoint directory. Only config.json is read, never a weight (`checkpoint_dir` says
    whether safetensors headers sit next to it)."""
    from decode_server.model.tiny import CONFIG_DIR

    bundled = CONFIG_DIR / f"{name_or_path}.json"
    path = Path(name_or_path).expanduser()
    if bundled.is_file() and not path.exists():
        path = bundled
    elif path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{name_or_path!r} is neither a config in configs/ ("
                                f"{', '.join(sorted(p.stem for p in CONFIG_DIR.glob('*.json')))}) nor a config.json "
                                "file or a checkpoint directory with one")
    with path.open() as fh:
        return json.load(fh), str(path)


def checkpoint_dir(config_path: str | Path) -> Path | None:
    """The directory of a config.json when safetensors files sit next to it (a checkpoint), else None: the planner
    then reads their headers (names, dtypes, shapes; no tensor) to know which projections are stored in FP8, as the
    loader does."""
    folder = Path(config_path).parent
    return folder if any(folder.glob("*.safetensors")) else None


@dataclass
class DensePlan:
    slots: int = 0
    pool_bytes: int = 0  # MLA rows + indexer keys, scratch slots included
    table_bytes: int = 0  # token → slot table (outside the budget)
    max_requests: int = 0
    limit: str = ""
    error: str | None = None


@dataclass
class HiSparsePlan:
    host_kv_budget_bytes: int = 0
    host_budget_source: str = ""
    num_buffers: int = 0
    host_pages: int = 0
    indexer_pages: int = 0
    prefill_staging_rows: int = 0
    device_pool_bytes: int = 0  # buffers + indexer keys + prefill staging, scratch slots included
    table_bytes: int = 0  # host-row / indexer-row tables, buffer slots, LRU state (outside the budget)
    host_pool_bytes: int = 0
    max_requests: int = 0
    limit: str = ""
    host_pool_needed_bytes: int = 0  # host rows of max_requests requests at the context
    best_max_requests: int = 0  # the most requests the device budget holds with a host pool sized for them
    best_host_kv_budget_bytes: int = 0  # that host pool
    error: str | None = None


@dataclass
class Plan:
    model: str
    model_type: str
    num_layers: int
    num_index_layers: int
    device: str
    tp_size: int
    ep_size: int
    dp_size: int  # attention data-parallel ranks: tp_size with --enable-dp-attention, else 1
    quantization: str  # "fp8": some weights stay block FP8 on the GPU; "none": all in the model dtype
    fp8_projections: str  # where the FP8 projections come from: the checkpoint's headers or DeepSeek's convention
    model_dtype: str
    kv_cache_dtype: str
    kv_row_bytes: int
    context_length: int
    request_kv_tokens: int
    page_size: int
    max_running_requests: int
    mem_fraction_static: float
    device_memory_bytes: int | None
    runtime_memory_bytes: int | None
    weights_bytes_per_gpu: int
    weights_by_kind: dict[str, int]
    parameters_per_gpu: int
    kv_budget_bytes_per_gpu: int
    kv_budget_source: str
    reserve_bytes_per_gpu: int | None  # (1 − f) × device memory: activations, CUDA graphs, NCCL, request tables
    kv_bytes_per_token: dict[str, int]
    hisparse_buffer_bytes_per_request: int
    attention: str
    dense: DensePlan
    hisparse: HiSparsePlan
    max_requests: dict[str, int]
    # Concurrent requests the node's tp_size GPUs hold, by attention layout ("tensor_parallel", and with tp_size > 1
    # "dp_attention"), each {"dense": n, "hisparse": n}: TP holds one GPU's requests, DP attention dp_size times a
    # rank's (every rank its own requests and KV). The layout not asked for is planned with the same flags.
    node_max_requests: dict[str, dict[str, int]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def make_plan(
    raw_config: dict[str, Any], engine: EngineConfig, *, model_name: str, device_memory: int | None = None, runtime_memory: int = DEFAULT_RUNTIME_MEMORY,
    host_memory: int | None = None, checkpoint: str | Path | None = None, compare_layouts: bool = True,
) -> Plan:
    """Plan one GPU of a deployment of the model `raw_config` (config.json) served with `engine` (its device must
    be "cpu" or "cuda"; its `quantization` is serve's `--quantization`, applied as the engine applies it).
    `device_memory`: the GPU's total memory (needed on CUDA unless the config has an explicit device KV budget).
    `host_memory`: the serving host's available memory, to apply the engine's cap on a derived host budget (None:
    no cap). `checkpoint`: the checkpoint directory, whose safetensors headers say which projections are stored in
    FP8 (None: every projection DeepSeek-style checkpoints store in FP8, `quantization.FP8_PROJECTIONS`).
    `compare_layouts`: with tp_size > 1 also plan the other attention layout (tensor-parallel attention or
    `--enable-dp-attention`) and report both in `node_max_requests`."""
    if engine.device not in ("cpu", "cuda"):
        raise ValueError("plan for --device cpu or --device cuda")
    device = torch.device(engine.device)
    model_config = ModelConfig.from_dict(raw_config)
    geometry = CacheGeometry.from_model_config(model_config)
    model_dtype = resolve_model_dtype(engine, device)
    kv_dtype = resolve_kv_dtype(engine, model_dtype)
    check_fp8_row_format(kv_dtype, geometry)
    warnings: list[str] = []
    if device.type == "cuda" and engine.attention_backend != "torch_native":
        problems = gpu_kernel_problems(model_config, model_dtype, engine.attention_tp_size)
        if problems:
            warnings.append("the GPU kernels do not support this model at this tp size (the server refuses it "
                            "unless --attention-backend torch_native): " + "; ".join(problems))

    dp = engine.dp_attention_size
    weights, fp8_source = plan_weights(model_config, model_dtype, engine.tp_size, engine.ep_size, engine.quantization,
                                       device, checkpoint, warnings, dp_size=dp)
    reserve = None
    if engine.device_kv_budget_bytes is not None:
        budget, source = engine.device_kv_budget_bytes, "--device-kv-budget"
    elif device.type == "cuda":
        if device_memory is None:
            raise ValueError("give --device-memory (e.g. H200, H100, 141GiB) or --device-kv-budget")
        free = device_memory - weights.total - runtime_memory
        budget = kv_sizing.kv_budget_from_memory(free, device_memory, engine.mem_fraction_static)
        source = "--mem-fraction-static"
        reserve = device_memory - int(engine.mem_fraction_static * device_memory)
        if budget <= 0:
            warnings.append(f"the weights ({weights.total / GIB:.1f} GiB) and runtime memory leave no KV budget in "
                            f"{engine.mem_fraction_static} × {device_memory / GIB:.1f} GiB")
    else:
        budget, source = CPU_DEFAULT_DEVICE_BUDGET, "CPU default"

    context = kv_sizing.resolve_context_length(engine.context_length, model_config.max_position_embeddings)
    kv_tokens = kv_sizing.request_kv_tokens(context)
    rules = kv_sizing.SizingRules.from_config(engine)
    if budget > 0:
        dense = _dense(budget, geometry, kv_dtype, rules, context, kv_tokens)
        hisparse = _hisparse(budget, geometry, kv_dtype, model_config.index_topk, rules, context, kv_tokens, engine,
                             host_memory)
    else:
        dense = DensePlan(limit="no KV budget", error="no device KV budget")
        hisparse = HiSparsePlan(limit="no KV budget", error="no device KV budget")
    hs = rules.hisparse
    top_k = hs.top_k or model_config.index_topk
    if dp > 1:
        attention = (f"data-parallel attention over {dp} ranks: each GPU holds only its own requests' KV (and, "
                     "in HiSparse mode, its own host pool), so the node holds the requests of all of them")
    else:
        attention = ("tensor-parallel: every GPU holds every request's KV (MLA's latent row is shared by the heads), "
                     "so the node holds the requests of one GPU")
    per_gpu = {"dense": dense.max_requests, "hisparse": hisparse.max_requests}
    node = {"dp_attention" if dp > 1 else "tensor_parallel": {k: v * dp for k, v in per_gpu.items()}}
    buffer_rows = (hs.device_buffer_size or 2 * top_k) + hs.num_recent_slots
    row = geometry.row_bytes(kv_dtype)
    plan = Plan(
        model=model_name, model_type=model_config.model_type, num_layers=geometry.num_layers,
        num_index_layers=geometry.num_index_layers, device=device.type, tp_size=engine.tp_size,
        ep_size=engine.ep_size, dp_size=dp, quantization=weights.quantization, fp8_projections=fp8_source,
        model_dtype=_dtype_name(model_dtype),
        kv_cache_dtype="fp8_e4m3" if is_fp8(kv_dtype) else _dtype_name(kv_dtype), kv_row_bytes=row,
        context_length=context, request_kv_tokens=kv_tokens, page_size=engine.page_size,
        max_running_requests=engine.max_running_requests, mem_fraction_static=engine.mem_fraction_static,
        device_memory_bytes=device_memory if device.type == "cuda" else None,
        runtime_memory_bytes=runtime_memory if source == "--mem-fraction-static" else None,
        weights_bytes_per_gpu=weights.total, weights_by_kind=weights.by_kind, parameters_per_gpu=weights.parameters,
        kv_budget_bytes_per_gpu=max(budget, 0), kv_budget_source=source, reserve_bytes_per_gpu=reserve,
        kv_bytes_per_token={"dense": geometry.bytes_per_token(kv_dtype),
                            "hisparse_device": geometry.index_key_bytes * geometry.num_index_layers,
                            "hisparse_host": row * geometry.num_layers},
        hisparse_buffer_bytes_per_request=buffer_rows * row * geometry.num_layers,
        attention=attention, dense=dense, hisparse=hisparse, max_requests=per_gpu, node_max_requests=node,
        warnings=warnings,
    )
    if compare_layouts and engine.tp_size > 1:
        other = engine.model_copy(update={"enable_dp_attention": dp == 1, "dp_size": engine.tp_size if dp == 1 else 1})
        label = "tensor_parallel" if dp > 1 else "dp_attention"
        try:
            plan.node_max_requests[label] = make_plan(
                raw_config, other, model_name=model_name, device_memory=device_memory, runtime_memory=runtime_memory,
                host_memory=host_memory, checkpoint=checkpoint, compare_layouts=False).node_max_requests[label]
        except ValueError as exc:  # e.g. FP8 pieces that only tensor-parallel attention cuts through a block
            plan.warnings.append(f"{label.replace('_', ' ')} not planned: {exc}")
    return plan


def plan_weights(
    config: ModelConfig, model_dtype: torch.dtype, tp_size: int, ep_size: int, quantization: str | None,
    device: torch.device, checkpoint: str | Path | None, warnings: list[str], dp_size: int = 1,
) -> tuple[WeightBytes, str]:
    """One GPU's weights as the engine stores them, and where the FP8 projections came from: the engine's
    `--quantization` rule (`resolve_quantization`, `wants_fp8`), the projections the loader would keep in FP8 (the
    checkpoint's, or all of DeepSeek's convention without one), and under "auto" the loader's fallback when a
    tensor-parallel piece cuts through a 128-block (everything dequantized); "fp8" refuses it (Fp8LayoutError, a
    ValueError)."""
    checkpoint_block(config)  # other quantization methods are refused, as the loader refuses them
    mode = resolve_quantization(quantization, device)
    if mode == "none" and quantization == "fp8":
        warnings.append(f"--quantization fp8 on {device.type}: the engine dequantizes (FP8 GEMMs run on CUDA only)")
    if not wants_fp8(mode, config, device):
        return planned_weight_bytes(config, model_dtype, tp_size, ep_size, dp_size=dp_size), ""
    if checkpoint is not None:
        from decode_server.model.loader import checkpoint_fp8_projections

        fp8: bool | set[str] = checkpoint_fp8_projections(checkpoint, config)
        source = "as the checkpoint stores them"
    else:
        fp8, source = True, "every projection DeepSeek-style checkpoints store in FP8 (no checkpoint read)"
    try:
        return planned_weight_bytes(config, model_dtype, tp_size, ep_size, fp8, dp_size), source
    except Fp8LayoutError as exc:
        if mode != "auto":
            raise
        warnings.append("quantization auto: at this tp / ep size some FP8 pieces cut through 128-blocks, so the "
                        "engine dequantizes every FP8 weight (--quantization fp8 refuses it): "
                        + str(exc).splitlines()[1].strip())
        return planned_weight_bytes(config, model_dtype, tp_size, ep_size, dp_size=dp_size), ""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dense(budget: int, geometry: CacheGeometry, kv_dtype: torch.dtype, rules: kv_sizing.SizingRules,
           context: int, kv_tokens: int) -> DensePlan:
    try:
        slots = kv_sizing.dense_slots(budget, geometry, kv_dtype, rules.page_size)
    except ValueError as exc:
        return DensePlan(limit="device KV cache", error=str(exc))
    capacity = kv_sizing.dense_capacity(slots, rules.page_size, rules.max_running_requests, kv_tokens)
    return DensePlan(slots=slots, pool_bytes=kv_sizing.dense_pool_bytes(slots, geometry, kv_dtype),
                     table_bytes=kv_sizing.dense_table_bytes(rules.max_running_requests, context),
                     max_requests=capacity.max_requests, limit=capacity.limit)


def _hisparse(budget: int, geometry: CacheGeometry, kv_dtype: torch.dtype, index_topk: int,
              rules: kv_sizing.SizingRules, context: int, kv_tokens: int, engine: EngineConfig,
              host_memory: int | None) -> HiSparsePlan:
    if engine.host_kv_budget_bytes is not None:
        host, source = engine.host_kv_budget_bytes, "--host-kv-budget"
    else:
        pools = engine.dp_attention_size  # DP attention: every rank pins its own pool
        host = kv_sizing.derived_host_budget(rules.hisparse.host_to_device_ratio, budget, host_memory, pools)
        share = f" shared by {pools} pools" if pools > 1 else ""
        source = f"{rules.hisparse.host_to_device_ratio:g} × the device KV budget" + (
            f" (capped at half of --host-memory{share})" if host < int(rules.hisparse.host_to_device_ratio * budget)
            else "")
    plan = HiSparsePlan(host_kv_budget_bytes=max(host, 0), host_budget_source=source)
    host_row_bytes = geometry.row_bytes(kv_dtype) * geometry.num_layers
    host_per_request = kv_sizing.pages_for(kv_tokens, rules.page_size) * rules.page_size * host_row_bytes
    try:
        layout = kv_sizing.hisparse_layout(budget, host, geometry, kv_dtype, index_topk, context, rules)
    except ValueError as exc:
        plan.error, plan.limit = str(exc), "device or host KV budget"
    else:
        allocated = kv_sizing.hisparse_bytes(layout)
        capacity = kv_sizing.hisparse_capacity(layout, kv_tokens)
        plan.num_buffers, plan.host_pages, plan.indexer_pages = layout.num_buffers, layout.host_pages, \
            layout.indexer_pages
        plan.prefill_staging_rows = layout.prefill_staging_rows
        plan.device_pool_bytes, plan.table_bytes = allocated.device_pools, allocated.device_tables
        plan.host_pool_bytes = allocated.host_pool
        plan.max_requests, plan.limit = capacity.max_requests, capacity.limit
        plan.host_pool_needed_bytes = capacity.max_requests * host_per_request
    best, best_host = kv_sizing.best_hisparse_batch(budget, geometry, kv_dtype, index_topk, rules, context,
                                                    kv_tokens, host_per_request)
    plan.best_max_requests, plan.best_host_kv_budget_bytes = best, best_host
    return plan


# -- text ---------------------------------------------------------------------------------------------------------

def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f} GiB"


def format_plan(plan: Plan) -> str:
    """The plan as the text `decode-server plan` prints."""
    out: list[str] = []
    add = out.append
    quant = {"fp8": "FP8 (128×128 block scales)", "none": plan.model_dtype}[plan.quantization]
    add(f"model {plan.model} ({plan.model_type}, {plan.num_layers} layers, {plan.num_index_layers} with an indexer)")
    mem = f", {_gib(plan.device_memory_bytes)} per GPU" if plan.device_memory_bytes else ""
    dp = f", dp attention {plan.dp_size}" if plan.dp_size > 1 else ""
    add(f"{plan.device}{mem}; tp {plan.tp_size}, ep {plan.ep_size}{dp}; weights {quant}; KV {plan.kv_cache_dtype} "
        f"({plan.kv_row_bytes} B rows); context {plan.context_length}; page {plan.page_size}; "
        f"max_running_requests {plan.max_running_requests}")
    add("")
    add("per GPU" if plan.device == "cuda" else "per rank (CPU)")
    kinds = ", ".join(f"{k} {_gib(v)}" for k, v in sorted(plan.weights_by_kind.items(), key=lambda kv: -kv[1])
                      if v >= (1 << 20))
    add(f"  weights              {_gib(plan.weights_bytes_per_gpu):>12}  {plan.parameters_per_gpu / 1e9:.2f} B "
        f"parameters ({kinds})")
    if plan.kv_budget_source == "--mem-fraction-static":
        add(f"  runtime memory       {_gib(plan.runtime_memory_bytes):>12}  CUDA context, allocator rounding "
            "(estimate: --runtime-memory)")
        add(f"  KV budget            {_gib(plan.kv_budget_bytes_per_gpu):>12}  = {plan.mem_fraction_static} × "
            f"{_gib(plan.device_memory_bytes)} − weights − runtime memory")
        add(f"  outside the budget   {_gib(plan.reserve_bytes_per_gpu):>12}  (1 − {plan.mem_fraction_static}) × "
            "device memory: activations, CUDA graphs, NCCL, request tables")
    else:
        add(f"  KV budget            {_gib(plan.kv_budget_bytes_per_gpu):>12}  ({plan.kv_budget_source})")
    add("")
    per = plan.kv_bytes_per_token
    add("KV bytes")
    add(f"  dense                {per['dense']:>12,} B per token  (MLA rows {plan.num_layers} × "
        f"{plan.kv_row_bytes} B + indexer keys {plan.num_index_layers} × 132 B)")
    add(f"  HiSparse device      {per['hisparse_device']:>12,} B per token  (indexer keys) + "
        f"{plan.hisparse_buffer_bytes_per_request / 2**20:,.1f} MiB per request (buffer)")
    add(f"  HiSparse host        {per['hisparse_host']:>12,} B per token  (MLA rows; one pool per "
        f"{'rank' if plan.dp_size > 1 else 'node'})")
    add("")
    add(f"largest batch at {plan.context_length} tokens ({plan.request_kv_tokens} of KV per request)")
    d = plan.dense
    if d.error:
        add(f"  dense      {0:>4}  ({d.error})")
    else:
        add(f"  dense      {d.max_requests:>4}  limit: {d.limit}; {d.slots:,} token slots, pool "
            f"{_gib(d.pool_bytes)}, tables {_gib(d.table_bytes)}")
    h = plan.hisparse
    if h.error:
        add(f"  hisparse   {0:>4}  ({h.error})")
    else:
        add(f"  hisparse   {h.max_requests:>4}  limit: {h.limit}; host pool {_gib(h.host_kv_budget_bytes)} "
            f"({h.host_budget_source}), {h.num_buffers} device buffers, indexer keys for "
            f"{h.indexer_pages * plan.page_size:,} tokens; device pools {_gib(h.device_pool_bytes)}, tables "
            f"{_gib(h.table_bytes)}")
        add(f"             host rows in use at that batch: {_gib(h.host_pool_needed_bytes)}")
    if h.best_max_requests:
        add(f"  hisparse   {h.best_max_requests:>4}  with a host pool sized for them: --host-kv-budget "
            f"{h.best_host_kv_budget_bytes / GIB:.1f}GiB")
    if len(plan.node_max_requests) > 1:
        add("")
        add(f"concurrent requests per node ({plan.tp_size} GPUs), by attention layout")
        names = {"tensor_parallel": "tensor-parallel attention",
                 "dp_attention": f"--enable-dp-attention --dp-size {plan.tp_size}"}
        for label in ("tensor_parallel", "dp_attention"):
            counts = plan.node_max_requests[label]
            mark = "  (this plan)" if (label == "dp_attention") == (plan.dp_size > 1) else ""
            add(f"  {names[label]:<34} dense {counts['dense']:>5}, hisparse {counts['hisparse']:>5}{mark}")
    add("")
    add(f"attention: {plan.attention}")
    if plan.quantization == "fp8":
        add(f"FP8 projections: {plan.fp8_projections}")
    for warning in plan.warnings:
        add(f"warning: {warning}")
    return "\n".join(out)
