"""The engine serves block-FP8 checkpoints with FP8 weights in GPU memory, and what it reports is what it holds:

- tiny-dsa through `Engine(EngineConfig(model_path="tiny-dsa"))` (default --quantization: the checkpoint's): FP8
  projections in memory, `weights_bytes_by_kind["fp8"]` / `["fp8_scales"]` equal to the checkpoint's FP8 / scale
  bytes (read from the safetensors headers), the absorbed bytes the FP8 W_UKᵀ copy (W_UV is a view of kv_b_proj), and
  the total equal to what loading allocated on the device (the caching allocator's requested bytes, within 512
  bytes per tensor); `--quantization none` dequantizes (bf16, more bytes);
- a random FP8 checkpoint of DeepSeek-V3.2's layer sizes written by the project's writer loads back with the same
  FP8 bytes, and its weight bytes are reported the same way.

Run: pytest -m gpu tests/engine/test_fp8_weight_bytes_gpu.py -v -s
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from safetensors import safe_open

from decode_server.config import EngineConfig
from decode_server.engine.engine import Engine
from decode_server.model import build_random_model, load_config, load_model, resolve_model_path
from decode_server.model.checkpoint_writer import write_random_checkpoint
from decode_server.model.loader import checkpoint_files
from decode_server.model.quantization import is_fp8_projection
from decode_server.model.weights import weight_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ALLOCATOR_ROUNDING = 512


def checkpoint_fp8_bytes(path) -> tuple[int, int, int]:
    """(FP8 projection bytes, their scale bytes, kv_b_proj values) of a checkpoint, from its headers."""
    fp8 = scales = kv_b = 0
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                meta = handle.get_slice(name)
                shape = meta.get_shape()
                numel = int(torch.Size(shape).numel())
                if meta.get_dtype() == "F8_E4M3" and is_fp8_projection(name):
                    fp8 += numel
                    scale_shape = handle.get_slice(name + "_scale_inv").get_shape()
                    scales += 4 * int(torch.Size(scale_shape).numel())
                if name.endswith("kv_b_proj.weight"):
                    kv_b += numel
    return fp8, scales, kv_b


def _requested() -> int:
    return int(torch.cuda.memory_stats().get("requested_bytes.all.current", 0))


def allocated_by(fn):
    """What `fn` left allocated, in bytes as requested from the caching allocator: memory_allocated counts whole
    blocks, and a large block keeps an unsplit remainder of up to 1 MiB (seen on an H100: 1.6 MiB over 114
    tensors), so it cannot check the count to the byte."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    before = _requested()
    out = fn()
    torch.cuda.synchronize()
    return out, _requested() - before


def test_tiny_dsa_engine_holds_and_reports_fp8_weights() -> None:
    path = resolve_model_path("tiny-dsa")
    fp8, scales, kv_b = checkpoint_fp8_bytes(path)
    (model, _), allocated = allocated_by(lambda: load_model("tiny-dsa", "cuda", torch.bfloat16))
    counted = weight_bytes(model)
    tensors = sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
    print(f"\ntiny-dsa FP8: {counted}; allocated by the load {allocated} B")
    assert model.quantization == "fp8"
    assert counted["fp8"] == fp8 and counted["fp8_scales"] == scales
    # tiny-dsa's heads are whole 128-blocks: the absorbed products read kv_b_proj's FP8 values (W_UV a view of its
    # rows, counted under "fp8"); the absorbed bytes are the FP8 W_UKᵀ copy (half of kv_b_proj: nope = v) + scales.
    layers = model.attention_layers()
    assert all(a.absorbed_fp8 for a in layers)
    assert sum(a.w_uk.nbytes for a in layers) == kv_b // 2
    assert counted["absorbed"] == sum(a.w_uk.nbytes + a.w_uk_scale.nbytes for a in layers)
    assert 0 <= allocated - counted["total"] <= ALLOCATOR_ROUNDING * tensors
    del model
    engine = Engine(EngineConfig(model_path="tiny-dsa", device="cuda", device_kv_budget_bytes=64 << 20,
                                 max_running_requests=4, chunked_prefill_size=256, disable_cuda_graph=True))
    stats = engine.stats()
    assert stats.quantization == "fp8"
    assert stats.weights_bytes == counted["total"]
    assert stats.weights_bytes_by_kind == {k: v for k, v in counted.items() if k != "total"}
    bf16 = Engine(EngineConfig(model_path="tiny-dsa", device="cuda", quantization="none",
                               device_kv_budget_bytes=64 << 20, max_running_requests=4, chunked_prefill_size=256,
                               disable_cuda_graph=True)).stats()
    assert bf16.quantization == "none" and bf16.weights_bytes_by_kind["fp8"] == 0
    assert bf16.weights_bytes > stats.weights_bytes
    print(f"tiny-dsa weights: FP8 {stats.weights_bytes} B, bf16 {bf16.weights_bytes} B")


def test_written_fp8_checkpoint_of_deepseek_layer_sizes_loads_back(tmp_path) -> None:
    bench = load_config("dsv32-bench")
    config = dataclasses.replace(bench, num_hidden_layers=2, indexer_types=bench.indexer_types[:2],
                                 mlp_layer_types=bench.mlp_layer_types[:2])  # 1 dense + 1 MoE layer
    files = write_random_checkpoint(config, tmp_path, device="cuda", seed=4, max_shard_bytes=2 << 30)
    assert len(files) >= 2
    (loaded, _), allocated = allocated_by(lambda: load_model(tmp_path, "cuda", torch.bfloat16))
    assert loaded.quantization == "fp8"
    reference = build_random_model(config, "cuda", torch.bfloat16, seed=4, quantization="fp8")
    mine, theirs = loaded.state_dict(), reference.state_dict()
    checked = 0
    for name, tensor in theirs.items():
        if tensor.dtype == torch.float8_e4m3fn:
            assert torch.equal(mine[name].view(torch.uint8), tensor.view(torch.uint8)), name
            assert torch.equal(mine[name + "_scale_inv"], theirs[name + "_scale_inv"]), name
            checked += 1
    assert checked > 15
    fp8, scales, _ = checkpoint_fp8_bytes(tmp_path)
    counted = weight_bytes(loaded)
    tensors = sum(1 for _ in loaded.parameters()) + sum(1 for _ in loaded.buffers())
    assert counted["fp8"] == fp8 and counted["fp8_scales"] == scales
    assert 0 <= allocated - counted["total"] <= ALLOCATOR_ROUNDING * tensors
    print(f"\n2-layer DeepSeek-V3.2-size FP8 checkpoint: {sum(f.stat().st_size for f in files) / 2**30:.2f} GiB on "
          f"disk, weights {counted}")
