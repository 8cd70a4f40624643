"""Absorbed MLA (through the backend contract) equals naive multi-head attention with expanded K/V, float64."""

from __future__ import annotations

import torch
from dsa_test_helpers import ListBackend, forward_tokens, small_model

from decode_server.engine.forward_batch import ForwardBatch
from decode_server.engine.forward_context import forward_context
from decode_server.model.rope import apply_rope_interleaved


def naive_mla(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, selected: list[torch.Tensor]):
    """Textbook MLA: per-head keys [k_nope ; k_pe] and values from kv_b_proj, causal softmax over `selected`."""
    num_tokens, heads = x.shape[0], attn.num_heads
    nope, rope, v_dim, rank = attn.nope_dim, attn.rope_dim, attn.v_dim, attn.kv_lora_rank
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(num_tokens, heads, nope + rope)
    q = torch.cat((q[..., :nope], apply_rope_interleaved(q[..., nope:], cos, sin)), dim=-1)
    kv_a = attn.kv_a_proj_with_mqa(x)
    c_kv = attn.kv_a_layernorm(kv_a[:, :rank])
    k_pe = apply_rope_interleaved(kv_a[:, rank:], cos, sin)  # [T, rope], shared by all heads
    kv = attn.kv_b_proj(c_kv).view(num_tokens, heads, nope + v_dim)
    k = torch.cat((kv[..., :nope], k_pe[:, None, :].expand(num_tokens, heads, rope)), dim=-1)
    v = kv[..., nope:]
    out = torch.zeros(num_tokens, heads, v_dim, dtype=x.dtype)
    for t in range(num_tokens):
        sel = selected[t]
        scores = torch.einsum("hd,shd->hs", q[t], k[sel]) * attn.softmax_scale
        out[t] = torch.einsum("hs,shd->hd", torch.softmax(scores, dim=-1), v[sel])
    return attn.o_proj(out.reshape(num_tokens, heads * v_dim))


def _run_layer(model, x, positions, backend):
    attn = model.model.layers[0].self_attn
    cos, sin = model.model.rotary(positions, x.dtype)
    batch = ForwardBatch.build([0], [0], [x.shape[0]], "cpu")
    with forward_context(batch, backend):
        return attn(x, cos, sin, cos.float(), sin.float()), attn, cos, sin


def test_absorbed_equals_naive_dense_prefix() -> None:
    """Prompt shorter than index_topk: every token attends to its whole causal prefix."""
    model = small_model(torch.float64, index_topk=64)
    torch.manual_seed(1)
    x = torch.randn(20, model.config.hidden_size, dtype=torch.float64)
    positions = torch.arange(20)
    got, attn, cos, sin = _run_layer(model, x, positions, ListBackend())
    want = naive_mla(attn, x, cos, sin, [torch.arange(t + 1) for t in range(20)])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_absorbed_equals_naive_on_indexer_selection() -> None:
    """Prompt longer than index_topk: both use exactly the rows the indexer chose."""
    model = small_model(torch.float64, index_topk=8)
    torch.manual_seed(2)
    x = torch.randn(30, model.config.hidden_size, dtype=torch.float64)
    backend = ListBackend()
    got, attn, cos, sin = _run_layer(model, x, torch.arange(30), backend)
    (_, topk), = backend.topk_log
    assert (topk[8:] >= 0).all() and (topk[:8] == -1).any()  # sparse beyond the first 8 tokens
    want = naive_mla(attn, x, cos, sin, [row[row >= 0].long() for row in topk])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_cache_rows_are_normalized_latent_and_roped_pe() -> None:
    model = small_model(torch.float64)
    backend = ListBackend()
    forward_tokens(model, backend, [3], [0], [[5, 6, 7]])
    rows = backend.kv[(0, 3)]
    assert rows.shape == (3, 576)
    # kv_a_layernorm has unit weight after random init: c_kv has RMS 1 (up to eps).
    torch.testing.assert_close(rows[:, :512].pow(2).mean(-1), torch.ones(3, dtype=torch.float64), rtol=1e-4, atol=0)
