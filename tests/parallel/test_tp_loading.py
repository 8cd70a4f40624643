"""Building and loading one tensor-parallel rank's shard, in one process (no communication needed): each rank
reads only its slice of every sharded tensor, FP8 pieces that cut through 128-blocks dequantize exactly, the
random benchmark model is the single-device model cut in pieces, and sizes that do not split are refused."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from safetensors import safe_open

import decode_server.model.loader as loader
from decode_server.model import build_random_model, load_config, load_model, resolve_model_path
from decode_server.model.construct import build_empty_model, piece
from decode_server.model.fp8 import dequantize_block_fp8, quantize_block_fp8
from decode_server.parallel.layers import parameter_shards
from decode_server.parallel.state import ParallelState

WORLD = 2
# Tensors every rank needs whole: latent KV / query-latent projections, norms, the indexer, the MoE gate.
REPLICATED = re.compile(r"(q_a_proj|kv_a_proj_with_mqa|layernorm|norm\.weight|indexer\.|mlp\.gate\.)")
ROUTED_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.")


class CountingSafeOpen:
    """safetensors' safe_open, counting the bytes of every tensor (or slice of one) read through it."""

    bytes_read = 0

    def __init__(self, path: str, framework: str) -> None:
        self._handle = safe_open(path, framework=framework)

    def __enter__(self) -> CountingSafeOpen:
        self._handle.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._handle.__exit__(*exc)

    def keys(self):
        return self._handle.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        tensor = self._handle.get_tensor(name)
        CountingSafeOpen.bytes_read += tensor.nbytes
        return tensor

    def get_slice(self, name: str):
        return _CountingSlice(self._handle.get_slice(name))


class _CountingSlice:
    def __init__(self, inner) -> None:
        self._inner = inner

    def get_shape(self):
        return self._inner.get_shape()

    def get_dtype(self):
        return self._inner.get_dtype()

    def __getitem__(self, index) -> torch.Tensor:
        tensor = self._inner[index]
        CountingSafeOpen.bytes_read += tensor.nbytes
        return tensor


def _checkpoint_bytes(name: str) -> dict[str, int]:
    path = resolve_model_path(name) / "model.safetensors"
    sizes = {}
    with safe_open(str(path), framework="pt") as handle:
        for key in handle.keys():  # noqa: SIM118
            sizes[key] = handle.get_tensor(key).nbytes
    return sizes


def _load_counting(monkeypatch, name: str, parallel: ParallelState | None):
    monkeypatch.setattr(loader, "safe_open", CountingSafeOpen)
    CountingSafeOpen.bytes_read = 0
    model, _ = load_model(name, "cpu", torch.float32, parallel=parallel)
    return model, CountingSafeOpen.bytes_read


@pytest.mark.parametrize("ep_size", [1, WORLD])
def test_each_rank_reads_only_its_slice(monkeypatch, ep_size):
    sizes = _checkpoint_bytes("tiny-dsa")
    scales = sum(n for k, n in sizes.items() if k.endswith("_scale_inv"))
    replicated = sum(n for k, n in sizes.items() if REPLICATED.search(k) and not k.endswith("_scale_inv"))
    sharded = sum(n for k, n in sizes.items() if not REPLICATED.search(k) and not k.endswith("_scale_inv"))
    _, whole = _load_counting(monkeypatch, "tiny-dsa", None)
    assert whole == sum(sizes.values())
    per_rank = []
    for rank in range(WORLD):
        model, read = _load_counting(monkeypatch, "tiny-dsa", ParallelState(rank, WORLD, ep_size))
        per_rank.append(read)
        # Its sharded tensors' 1/N, all replicated tensors, and at most every scale (a piece reads the scale
        # rows/cols it touches, whole blocks, so neighbouring ranks may both read a scale block).
        want = sharded / WORLD + replicated
        assert want <= read <= want + scales, f"rank {rank} read {read} bytes, expected {want} (+ scales)"
        if ep_size > 1:
            mine = {int(m.group(1)) for k in model.state_dict() if (m := ROUTED_EXPERT.search(k))}
            assert mine == set(range(rank * 4, rank * 4 + 4)), "expert parallel: each rank holds its own experts"
    # Together the ranks read the checkpoint once, plus the other ranks' copies of replicated tensors and scales.
    assert sum(per_rank) <= whole + (WORLD - 1) * (replicated + scales)
    assert sharded > 4 * replicated, "the check is meaningful only if most bytes are sharded"


@pytest.mark.parametrize("ep_size", [1, WORLD])
def test_loaded_shards_are_pieces_of_the_single_device_model(ep_size):
    """FP8 weights included: the expert projections (128 rows / cols) are cut at 64, inside a 128-block."""
    whole, _ = load_model("tiny-dsa", "cpu", torch.float32)
    full = whole.state_dict()
    for rank in range(WORLD):
        model, _ = load_model("tiny-dsa", "cpu", torch.float32, parallel=ParallelState(rank, WORLD, ep_size))
        shards = parameter_shards(model)
        assert shards, "nothing was sharded"
        cut_inside_block = [n for n, s in shards.items() if full[n].shape[s.dim] // WORLD % 128]
        if ep_size == 1:
            assert cut_inside_block, "no FP8 piece cut through a 128-block: the ragged case is untested"
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, piece(full[name], shards.get(name))), f"rank {rank}: {name} differs"
        for attn, whole_attn in zip(model.attention_layers(), whole.attention_layers(), strict=True):
            heads = attn.num_heads
            assert heads == whole_attn.num_heads // WORLD
            assert torch.equal(attn.w_uk, whole_attn.w_uk[rank * heads : (rank + 1) * heads])


def test_fp8_piece_dequantizes_like_the_whole():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 520, generator=gen)
    fp8, scale = quantize_block_fp8(weight)
    whole = dequantize_block_fp8(fp8, scale)
    for rows, cols in [((64, 200), (0, 520)), ((0, 300), (100, 390)), ((130, 131), (255, 257))]:
        r0, c0 = rows[0] // 128, cols[0] // 128
        r1, c1 = -(-rows[1] // 128), -(-cols[1] // 128)
        got = dequantize_block_fp8(fp8[rows[0] : rows[1], cols[0] : cols[1]], scale[r0:r1, c0:c1],
                                   origin=(rows[0], cols[0]))
        assert torch.equal(got, whole[rows[0] : rows[1], cols[0] : cols[1]])
    with pytest.raises(ValueError, match="at offset"):
        dequantize_block_fp8(fp8[64:200], scale[:1], origin=(64, 0))


@pytest.mark.parametrize("name", ["tiny-dsa", "tiny-glm5"])
def test_random_model_shards_are_pieces_of_the_single_device_model(name):
    config = load_config(name)
    full = build_random_model(config, "cpu", torch.float32, seed=5).state_dict()
    for ep_size in (1, WORLD):
        for rank in range(WORLD):
            model = build_random_model(config, "cpu", torch.float32, seed=5,
                                       parallel=ParallelState(rank, WORLD, ep_size))
            shards = parameter_shards(model)
            for key, tensor in model.state_dict().items():
                assert torch.equal(tensor, piece(full[key], shards.get(key))), f"{name} rank {rank}: {key}"


@pytest.mark.parametrize(("change", "message"), [
    ({"num_attention_heads": 12, "num_key_value_heads": 12}, "num_attention_heads"),
    ({"vocab_size": 1022}, "vocab_size"),
    ({"intermediate_size": 500}, "intermediate_size"),
    ({"moe_intermediate_size": 100}, "moe_intermediate_size"),
])
def test_sizes_that_do_not_split_are_refused(change, message):
    config = dataclasses.replace(load_config("tiny-dsa"), **change)
    build_empty_model(config, "cpu", torch.float32, ParallelState(0, 2))  # splits in 2
    with pytest.raises(ValueError, match=f"{message}.*not divisible by the tensor-parallel size 8"):
        build_empty_model(config, "cpu", torch.float32, ParallelState(0, 8))


def test_experts_that_do_not_split_and_bad_sizes_are_refused():
    config = load_config("tiny-dsa")  # 8 routed experts
    build_empty_model(config, "cpu", torch.float32, ParallelState(0, 4, 4))
    with pytest.raises(ValueError, match="n_routed_experts.*not divisible by the tensor-parallel size 16"):
        build_empty_model(dataclasses.replace(config, vocab_size=1024, num_attention_heads=16),
                          "cpu", torch.float32, ParallelState(0, 16, 16))
    with pytest.raises(ValueError, match="ep_size 3 is not supported with tp_size 4"):
        ParallelState(0, 4, 3)
    with pytest.raises(ValueError, match="tp_rank 2 is outside"):
        ParallelState(2, 2)
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size 3"):
        load_model("tiny-dsa", "cpu", torch.float32, parallel=ParallelState(0, 3))  # before reading any data
