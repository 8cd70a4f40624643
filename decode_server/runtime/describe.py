"""What an engine process reports when it is ready (`ReadyMsg.info`): the api logs it at start-up and serves it in
/v1/models and /server_info."""

from __future__ import annotations

from typing import Any

from decode_server.config import EngineConfig


def describe_engine(engine: Any, config: EngineConfig, role: Any = None) -> dict[str, Any]:
    """Mode, device, context length, pool sizes and memory budgets of a built engine (and its PD role)."""
    from decode_server.model import resolve_model_path

    info: dict[str, Any] = {
        "model_path": config.model_path,
        "model_dir": str(resolve_model_path(config.model_path)),
        "mode": "hisparse" if config.enable_hisparse else "dense",
        "kv_cache_dtype": config.kv_cache_dtype,
        "max_running_requests": config.max_running_requests,
        "max_queued_requests": config.max_queued_requests,
        "disaggregation_mode": config.disaggregation.mode,
    }
    if role is not None:
        info["disaggregation"] = role.describe()
    for attr in ("context_length", "max_request_tokens", "device", "kv_dtype", "model_dtype"):
        value = getattr(engine, attr, None)
        if value is not None:
            info[attr] = value if isinstance(value, int | float | str | bool) else str(value)
    model_config = getattr(engine, "model_config", None)
    for attr in ("vocab_size", "num_hidden_layers", "index_topk"):
        value = getattr(model_config, attr, None)
        if isinstance(value, int):
            info[attr] = value
    stats = engine.stats()
    info["pools"] = {
        "host_pages": stats.host_pages.total,
        "device_slots": stats.device_slots.total,
        "indexer_slots": stats.indexer_slots.total,
        "dense_kv_slots": stats.dense_kv_slots.total,
    }
    info["memory"] = _memory_budgets(engine, config, stats)
    # Whether the step loop runs one pass ahead of the device, and the decode batch sizes replayed as CUDA graphs
    # ([]: every decode step eager); what an operator checks first when a deployment is slower than expected.
    info["overlap_schedule"] = bool(getattr(engine, "overlap", False))
    runner = getattr(engine, "graph_runner", None)
    info["cuda_graph_batch_sizes"] = runner.captured if runner is not None else []
    return info


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.3f} GiB"


def _memory_budgets(engine: Any, config: EngineConfig, stats: Any) -> dict[str, str]:
    """Bytes behind each pool, from its size in tokens (rows of every layer; indexer keys of the layers that run
    the indexer, 132 B each)."""
    geometry = engine.cache_geometry
    layers = geometry.num_layers
    row_bytes = geometry.row_bytes(engine.kv_dtype)
    index_bytes = geometry.num_index_layers * geometry.index_key_bytes
    if config.enable_hisparse:
        host_tokens = stats.host_pages.total * config.page_size
        return {
            "host_kv": f"{_gib(host_tokens * layers * row_bytes)} ({host_tokens} tokens)",
            "device_buffers": f"{_gib(stats.device_slots.total * layers * row_bytes)} "
            f"({stats.device_slots.total} slots)",
            "indexer_keys": f"{_gib(stats.indexer_slots.total * index_bytes)} "
            f"({stats.indexer_slots.total} tokens)",
        }
    tokens = stats.dense_kv_slots.total
    return {"device_kv": f"{_gib(tokens * geometry.bytes_per_token(engine.kv_dtype))} ({tokens} tokens)"}
