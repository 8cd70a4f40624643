"""decode_server/model/fused_ops.py on the CPU: every call is the eager reference (the Triton kernels run only on
CUDA tensors), including the `out=` and in-place forms the model uses and batch-invariant mode's row tiles."""

from __future__ import annotations

import torch

from decode_server.model import batch_invariant, fused_ops
from decode_server.model.layers import RMSNorm
from decode_server.model.rope import apply_rope_half_split, apply_rope_interleaved


def test_norm_and_add_norm_are_eager_on_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 96, generator=gen, dtype=torch.float64)
    delta = torch.randn(6, 96, generator=gen, dtype=torch.float64)
    norm = RMSNorm(96, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=gen)
    want = fused_ops.rms_norm_eager(x, norm.weight, 1e-5)
    x32 = x.float()
    direct = norm.weight.float() * (x32 / x32.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt())
    assert torch.allclose(want.float(), direct, rtol=1e-6)
    assert torch.equal(norm(x), want)
    out = torch.zeros(6, 160, dtype=torch.float64)
    assert norm(x, out=out[:, :96]).data_ptr() == out.data_ptr()
    assert torch.equal(out[:, :96], want) and not bool(out[:, 96:].any())
    summed, normed = norm.add_forward(x, delta)
    assert torch.equal(summed, x + delta) and torch.equal(normed, norm(x + delta))
    with batch_invariant.batch_invariant_mode(True):
        assert torch.allclose(norm(x), want, rtol=1e-12, atol=0)


def test_rope_is_eager_on_cpu_with_out_and_in_place() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(4, 3, 192, generator=gen)
    angles = torch.rand(4, 32, generator=gen, dtype=torch.float64) * 10
    cos, sin = torch.cos(angles).float(), torch.sin(angles).float()
    for interleaved, ref in ((True, apply_rope_interleaved), (False, apply_rope_half_split)):
        want = ref(q[..., 128:], cos, sin)
        assert torch.equal(fused_ops.rope(q[..., 128:], cos, sin, interleaved), want)
        big = torch.zeros(4, 3, 576)
        fused_ops.rope(q[..., 128:], cos, sin, interleaved, out=big[..., 512:])
        assert torch.equal(big[..., 512:], want) and not bool(big[..., :512].any())
        x = q.clone()
        fused_ops.rope(x[..., 128:], cos, sin, interleaved, out=x[..., 128:])
        assert torch.equal(x[..., 128:], want) and torch.equal(x[..., :128], q[..., :128])


def test_fp8_quantizations_are_eager_on_cpu() -> None:
    """The index keys' and the KV rows' FP8 quantization dispatch to the eager references off CUDA (the CPU path
    and the kernels' oracle); the KV cache's row encoder goes through the dispatcher."""
    from decode_server.engine.kv_rows import encode_rows
    from kernels.fp8_rows import pack_fp8_rows
    from kernels.indexer_ref import quantize_index_keys

    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(5, 128, generator=gen) * 3
    got_q, got_s = fused_ops.quantize_index_keys(keys)
    want_q, want_s = quantize_index_keys(keys)
    assert torch.equal(got_s, want_s) and torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    rows = torch.randn(6, 576, generator=gen)
    assert torch.equal(fused_ops.pack_fp8_rows(rows), pack_fp8_rows(rows))
    assert torch.equal(encode_rows(rows, torch.float8_e4m3fn), pack_fp8_rows(rows))


def test_silu_mul_is_eager_on_cpu_and_the_mlp_uses_it(monkeypatch) -> None:
    import torch.nn.functional as F

    from decode_server.model.layers import MLP

    gen = torch.Generator().manual_seed(2)
    both = torch.randn(5, 64, generator=gen).to(torch.bfloat16) * 8
    gate, up = both[:, :32], both[:, 32:]
    assert torch.equal(fused_ops.silu_mul(gate, up), F.silu(gate) * up)
    mlp = MLP(16, 32)
    x = torch.randn(3, 16, generator=gen)
    calls = []
    original = fused_ops.silu_mul
    monkeypatch.setattr(fused_ops, "silu_mul", lambda g, u: calls.append(g.shape) or original(g, u))
    with torch.no_grad():
        want = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        assert torch.equal(mlp(x), want) and calls == [torch.Size([3, 32])]
