"""The project's checkpoint writer: a model saved as a Hugging Face style checkpoint in DeepSeek's stored form.

Used for the embedded tiny models (decode_server/model/tiny.py) and for random block-FP8 checkpoints of any size
(tests and benchmarks: `python -m decode_server.model.checkpoint_writer --config dsv32-bench --out DIR --device
cuda`). Stored form:
  - a model with block-FP8 storage (decode_server/model/quantization.py) saves its FP8 weights and their
    `weight_scale_inv` as they are (float8_e4m3fn + float32), so loading the checkpoint back with FP8 storage
    gives the same bytes;
  - float weights follow `stored_form`: 2-D projections are quantized to FP8 with 128×128 block scales (unless a
    dimension is ragged: kv_a_proj_with_mqa's 576 rows, which transformers' dequantizer cannot read), embeddings,
    LM head, router and the indexer's weights_proj in bf16, norms and biases in float32.
config.json carries `quantization_config` (fp8, e4m3, dynamic activations, 128×128 blocks) whenever a tensor is
FP8. Large checkpoints are split into shards with `model.safetensors.index.json`, as downloaded ones are.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from decode_server.model.fp8 import quantize_block_fp8

logger = logging.getLogger(__name__)

FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [128, 128]}
INDEX_FILE = "model.safetensors.index.json"


def stored_form(name: str, tensor: torch.Tensor, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """How a DeepSeek checkpoint stores a float tensor: FP8 projections, bf16 embeddings/router, fp32 norms."""
    ragged = any(dim % b for dim, b in zip(tensor.shape, block, strict=False))
    projection = name.endswith(("proj.weight", "indexer.wk.weight", "indexer.wq_b.weight"))
    if tensor.dim() == 2 and projection and not name.endswith("weights_proj.weight") and not ragged:
        # Ragged-edge blocks (kv_a_proj_with_mqa: 576 rows) stay bf16 here only because transformers'
        # dequantizer cannot read them; our loader can (tests/model/test_loader.py).
        quant, scale_inv = quantize_block_fp8(tensor, block)
        return {name: quant, name + "_scale_inv": scale_inv}
    if name.endswith(("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight", "weights_proj.weight")):
        return {name: tensor.to(torch.bfloat16)}
    return {name: tensor.float()}


def checkpoint_tensors(model: torch.nn.Module, block: tuple[int, int] = (128, 128)) -> dict[str, torch.Tensor]:
    """The model's state in stored form, on the CPU, contiguous (FP8-storage weights and scales as they are)."""
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith("_scale_inv"):
            continue  # saved with its weight
        scale = state.get(name + "_scale_inv")
        if tensor.dtype == torch.float8_e4m3fn and scale is not None:
            tensors[name] = tensor.detach().cpu().contiguous()
            tensors[name + "_scale_inv"] = scale.detach().float().cpu().contiguous()
            continue
        for key, value in stored_form(name, tensor.detach().float().cpu().contiguous(), block).items():
            tensors[key] = value.contiguous()
    return tensors


def save_checkpoint(tensors: dict[str, torch.Tensor], config: dict[str, Any], out_dir: str | Path,
                    max_shard_bytes: int | None = None) -> list[Path]:
    """Write `tensors` (one file, or shards of at most `max_shard_bytes` with an index) and config.json (with
    `quantization_config` when a tensor is FP8). Returns the safetensors files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    if any(t.dtype == torch.float8_e4m3fn for t in tensors.values()):
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    files: list[Path] = []
    if len(shards) == 1:
        files.append(out / "model.safetensors")
        save_file(shards[0], str(files[0]), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            file = out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file.name))
            files.append(file)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return files


def write_random_checkpoint(config: str | Any, out_dir: str | Path, *, device: str = "cpu", seed: int = 0,
                            quantization: str = "fp8", max_shard_bytes: int | None = 5 << 30) -> list[Path]:
    """A random model of a config (a ModelConfig, or a name in configs/ or a file) written as a checkpoint: with
    `quantization` "fp8" its projections are random block FP8 drawn on `device` (decode_server/model/construct.py,
    the same weights `build_random_model(config, device, seed=seed, quantization="fp8")` gives) and saved as they
    are; "none": float weights in stored form (quantized by `stored_form`)."""
    from decode_server.model import build_random_model, load_config

    if isinstance(config, str):
        config = load_config(config)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    model = build_random_model(config, device, dtype, seed=seed, quantization=quantization)
    raw = config.to_hf_dict()
    raw["torch_dtype"] = "bfloat16"
    return save_checkpoint(checkpoint_tensors(model, config.weight_block_size), raw, out_dir, max_shard_bytes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write a random DSA checkpoint (block-FP8 projections by default)")
    p.add_argument("--config", required=True, help="config name in configs/ (e.g. dsv32-bench) or a JSON file")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--device", default="cpu", help="where the random weights are drawn (cuda: seconds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", choices=["fp8", "none"], default="fp8")
    p.add_argument("--max-shard-gib", type=float, default=5.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    files = write_random_checkpoint(args.config, args.out, device=args.device, seed=args.seed,
                                    quantization=args.quantization, max_shard_bytes=int(args.max_shard_gib * 2**30))
    total = sum(f.stat().st_size for f in files)
    logger.info("wrote %d file(s), %.2f GiB, to %s", len(files), total / 2**30, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
