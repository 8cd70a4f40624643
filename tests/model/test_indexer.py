"""Lightning indexer: FP8 key packing, folded head weights, Hadamard rotation, top-k vs float64 brute force."""

from __future__ import annotations

import torch
from dsa_test_helpers import ListBackend, forward_tokens, small_model

from decode_server.model.indexer import hadamard_matrix
from decode_server.model.rope import apply_rope_half_split
from kernels.indexer_ref import dequantize_index_keys, quantize_index_keys


def test_fp8_key_packing_round_trips() -> None:
    torch.manual_seed(0)
    keys = torch.randn(64, 128) * torch.logspace(-3, 3, 64).unsqueeze(1)
    fp8, scales = quantize_index_keys(keys)
    assert fp8.dtype == torch.float8_e4m3fn and fp8.shape == (64, 128) and scales.shape == (64,)
    assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)  # powers of two
    back = dequantize_index_keys(fp8, scales)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values; tiny ones sit near the scale's grid.
    err = (back - keys).abs()
    assert (err <= keys.abs() * 2**-4 + scales.unsqueeze(1) * 2**-9).all()
    # Packing what was unpacked loses nothing (the scale may halve when amax rounded down, values stay).
    fp8_again, scales_again = quantize_index_keys(back)
    assert torch.equal(dequantize_index_keys(fp8_again, scales_again), back)
    # Values already on the e4m3 grid with a power-of-two amax/448 pack bit-exactly.
    grid = fp8[:, :].float() * 2.0**-3
    grid[:, 0] = 448 * 2.0**-3
    fp8_grid, scale_grid = quantize_index_keys(grid)
    assert torch.equal(scale_grid, torch.full((64,), 2.0**-3))
    assert torch.equal(dequantize_index_keys(fp8_grid, scale_grid), grid)


def test_hadamard_is_orthogonal_and_symmetric() -> None:
    h = hadamard_matrix(128).double()
    torch.testing.assert_close(h @ h.T, torch.eye(128, dtype=torch.float64), rtol=0, atol=1e-6)
    torch.testing.assert_close(h, h.T)


def test_walsh_hadamard_is_the_matrix_product_row_by_row() -> None:
    """The fast transform the model rotates by equals the product with the normalized Hadamard matrix to float32
    rounding, is row-local (a row alone gives the bits it gives in a batch), and leaves a dimension that is not a
    power of two unchanged (as hadamard_matrix's identity)."""
    from kernels.indexer_ref import walsh_hadamard

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(33, 4, 128, generator=gen) * 7
    got = walsh_hadamard(x)
    want = x.double() @ hadamard_matrix(128).double()
    assert (got.double() - want).abs().max().item() <= 1e-5 * x.abs().max().item()
    assert torch.equal(walsh_hadamard(x[5:6, 2:3]), got[5:6, 2:3])
    assert (walsh_hadamard(got) - x).abs().max().item() <= 1e-5 * x.abs().max().item()  # H·H = I
    odd = torch.randn(3, 96, generator=gen)
    assert torch.equal(walsh_hadamard(odd), odd)


def test_indexer_outputs_follow_the_formula() -> None:
    """Keys = H·RoPE_half(LayerNorm(wk x)); weights = weights_proj(x)·Hi^-0.5·128^-0.5; q·k preserved by H."""
    model = small_model(torch.float64)
    indexer = model.model.layers[0].self_attn.indexer
    torch.manual_seed(3)
    x = torch.randn(5, 64, dtype=torch.float64)
    c_q = torch.randn(5, 48, dtype=torch.float64)
    positions = torch.arange(100, 105)
    cos, sin = model.model.rotary(positions, torch.float32)
    out = indexer(x, c_q, cos, sin)
    k = torch.nn.functional.layer_norm(indexer.wk(x), (128,), indexer.k_norm.weight, indexer.k_norm.bias, 1e-6)
    k = torch.cat((apply_rope_half_split(k[:, :64], cos.double(), sin.double()), k[:, 64:]), dim=-1)
    q = indexer.wq_b(c_q).view(5, 4, 128)
    q = torch.cat((apply_rope_half_split(q[..., :64], cos.double(), sin.double()), q[..., 64:]), dim=-1)
    keys = dequantize_index_keys(out.keys_fp8, out.key_scales).double()
    rotated_back = keys @ hadamard_matrix(128).double()  # H is its own inverse
    assert ((rotated_back - k).abs() <= k.abs().amax(-1, keepdim=True) * 2**-4).all()
    # Rotation keeps dot products (up to float32 rounding of q).
    torch.testing.assert_close(torch.einsum("thd,sd->ths", out.q.double(), keys),
                               torch.einsum("thd,sd->ths", q, rotated_back), rtol=1e-4, atol=1e-4)
    want_w = indexer.weights_proj(x.float()).double() * 4**-0.5 * 128**-0.5
    torch.testing.assert_close(out.weights.double(), want_w, rtol=1e-6, atol=1e-7)


def test_topk_matches_float64_brute_force() -> None:
    """The positions the model hands to sparse attention are the float64 top-k of Σ_h w_h ReLU(q_h·k)·scale."""
    model = small_model(torch.float64, index_topk=8)
    backend = ListBackend()
    captured: list = []
    indexer = model.model.layers[1].self_attn.indexer
    indexer.register_forward_hook(lambda mod, args, out: captured.append(out))
    tokens = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    forward_tokens(model, backend, [0], [0], [tokens])
    (out,) = captured
    topk = next(t for layer, t in backend.topk_log if layer == 1)
    keys = dequantize_index_keys(out.keys_fp8, out.key_scales).double()
    for t in range(40):
        if t + 1 <= 8:
            assert topk[t, : t + 1].tolist() == list(range(t + 1)) and (topk[t, t + 1 :] == -1).all()
            continue
        scores = (torch.relu(out.q[t].double() @ keys[: t + 1].T) * out.weights[t].double()[:, None]).sum(0)
        want = torch.topk(scores, 8).indices
        got = topk[t].long()
        assert set(got.tolist()) <= set(range(t + 1))
        # Equal as sets unless the 8th and 9th best scores tie to float32 precision.
        kth, next_best = torch.topk(scores, 9).values[7:9]
        if (kth - next_best).abs() > 1e-5 * kth.abs():
            assert set(got.tolist()) == set(want.tolist()), f"token {t}"
