"""How `build_empty_model` gives a model storage (decode_server/model/construct.py): module by module, each stack
made right after its module's own tensors, the absorbed MLA copies reserved at construction and filled in place, so
that a build leaves no device memory stranded (measured on a GPU by tests/model/test_construct_memory_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from decode_server.model import build_random_model, load_config
from decode_server.model.construct import build_empty_model, materialize_


def test_materialize_gives_meta_tensors_storage_and_leaves_the_others() -> None:
    with torch.device("meta"):
        outer = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    outer[1].weight = outer[0].weight = nn.Parameter(torch.empty(3, 4, device="meta"))  # shared by two modules
    real = torch.ones(2)
    outer[1].bias = nn.Parameter(real)
    outer[0].register_buffer("table", torch.empty(5, device="meta"))
    materialize_(outer, torch.device("cpu"), {})
    tensors = [t for _, t in outer.named_parameters(remove_duplicate=False)] + list(outer.buffers())
    assert all(t.device.type == "cpu" for t in tensors)
    assert outer[0].weight is outer[1].weight  # still one tensor
    assert outer[1].bias.data_ptr() == real.data_ptr()  # had storage: left alone
    assert isinstance(outer[0].weight, nn.Parameter) and outer[0].table.shape == (5,)


@pytest.mark.parametrize(("name", "fp8"), [("tiny-dsa", True), ("tiny-glm5", True), ("tiny-dsa", False)])
def test_absorbed_copies_are_reserved_at_construction_and_filled_in_place(name: str, fp8: bool) -> None:
    config = load_config(name)
    model = build_empty_model(config, "cpu", torch.float32, fp8=fp8)
    attn = model.model.layers[0].self_attn
    assert not attn.weights_absorbed
    reserved = {key: getattr(attn, key) for key in attn.absorbed_layout()}
    assert reserved and all(t.numel() > 0 for t in reserved.values())
    with pytest.raises(RuntimeError, match="absorb_weights"):
        attn(torch.zeros(1, config.hidden_size), *(torch.zeros(1, 1) for _ in range(4)))
    model.finalize_weights()
    assert attn.weights_absorbed
    for key, tensor in reserved.items():
        assert getattr(attn, key).data_ptr() == tensor.data_ptr(), key  # filled in place, no new allocation


@pytest.mark.parametrize("name", ["tiny-dsa", "tiny-glm5"])
def test_absorbed_copies_hold_the_same_values_as_fresh_copies(name: str) -> None:
    """The in-place fill gives the bits `absorb_weights` gave before, when it allocated each copy."""
    model = build_random_model(load_config(name), "cpu", torch.float32, seed=3, quantization="fp8")
    for attn in model.attention_layers():
        kept = {key: getattr(attn, key).clone() for key in ("w_uk", "w_uv", "w_uk_scale", "w_uv_scale")}
        for key in attn.absorbed_layout():
            setattr(attn, key, torch.empty(0))  # as a module built before reservation: absorb allocates
        attn.absorb_weights()
        for key, value in kept.items():
            fresh = getattr(attn, key)
            assert fresh.dtype == value.dtype and torch.equal(fresh.view(torch.uint8), value.view(torch.uint8)), key
