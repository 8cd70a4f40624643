"""The one-kernel RMSNorm, residual add + RMSNorm and rotary embedding (decode_server/model/fused_ops.py,
kernels/norm_rope_triton.py) on the GPU against the eager references they replace:
- rotary embedding: the same bits as eager, both pair layouts, bf16 and float32, strided inputs (a slice of a
  projection's output), written into a slice of a larger tensor and in place;
- RMSNorm: eager's result within one rounding of the output dtype (only the float32 sum's order differs), equal
  on most elements; the residual sum of `add_rms_norm` bit for bit `x + delta`;
- every row depends only on itself (a row alone gives the same bits as inside a batch), and a CUDA-graph replay
  gives the same bits as the eager launch;
- the whole model: the fused path against eager (`fused_ops.set_enabled(False)`) on the same random weights;
- the indexer's query and key chains (`fused_ops.index_query` / `index_keys`): eager's bits, and the e4m3 query
  the same scores as eager's float query;
- SwiGLU's silu(gate) · up (`fused_ops.silu_mul`, kernels/swiglu_triton.py): eager's bits (`F.silu(g) * u`),
  strided and contiguous, under a CUDA-graph replay too, and the dense MLP and the MoE's grouped experts give the
  same bits with the kernel as without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from decode_server.model import fused_ops
from decode_server.model.rope import apply_rope_half_split, apply_rope_interleaved

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = [torch.bfloat16, torch.float32]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _eager_rope(x, cos, sin, interleaved: bool) -> torch.Tensor:
    return (apply_rope_interleaved if interleaved else apply_rope_half_split)(x, cos, sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize(("tokens", "heads"), [(1, 128), (7, 64), (33, 1), (2, 3)])
def test_rope_gives_eagers_bits(dtype: torch.dtype, interleaved: bool, tokens: int, heads: int) -> None:
    gen = _gen(tokens * 131 + heads)
    q = torch.randn(tokens, heads, 192, device="cuda", generator=gen).to(dtype) * 4
    angles = torch.rand(tokens, 32, device="cuda", generator=gen, dtype=torch.float64) * 1000
    cos, sin = torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)
    x = q[..., 128:]  # strided: the rope part of each head
    want = _eager_rope(x, cos, sin, interleaved)
    got = fused_ops.rope(x, cos, sin, interleaved)
    assert got.dtype == want.dtype and torch.equal(got, want)
    # Into a slice of a larger tensor (the absorbed query's last 64 columns), the rest untouched.
    big = torch.full((tokens, heads, 576), 7.0, device="cuda", dtype=dtype)
    fused_ops.rope(x, cos, sin, interleaved, out=big[..., 512:])
    assert torch.equal(big[..., 512:], want) and bool((big[..., :512] == 7.0).all())
    # In place on the first half of a float32 indexer head (the indexer's use).
    head = torch.randn(tokens, heads, 128, device="cuda", generator=gen).to(dtype)
    first = head[..., :64]
    want_first, rest = _eager_rope(first, cos, sin, interleaved), head[..., 64:].clone()
    fused_ops.rope(first, cos, sin, interleaved, out=first)
    assert torch.equal(head[..., :64], want_first) and torch.equal(head[..., 64:], rest)


def test_rope_on_two_dim_rows_and_float32_angles_with_bf16_x() -> None:
    gen = _gen(5)
    kv_a = torch.randn(9, 576, device="cuda", generator=gen).to(torch.bfloat16)
    angles = torch.rand(9, 32, device="cuda", generator=gen, dtype=torch.float64) * 50
    for cos, sin in ((torch.cos(angles).to(torch.bfloat16), torch.sin(angles).to(torch.bfloat16)),
                     (torch.cos(angles).float(), torch.sin(angles).float())):
        want = apply_rope_interleaved(kv_a[:, 512:], cos, sin)
        got = fused_ops.rope(kv_a[:, 512:], cos, sin, True)
        assert got.dtype == want.dtype and torch.equal(got, want)


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each element of t, in t's dtype's precision (as float32)."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[t.dtype]
    a = t.float().abs().clamp_min(torch.finfo(t.dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(a)) - mantissa)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n"), [(1, 7168), (16, 7168), (64, 6144), (5, 1536), (3, 512), (2, 100)])
def test_rms_norm_within_one_rounding_of_eager(dtype: torch.dtype, rows: int, n: int) -> None:
    gen = _gen(rows * n)
    x = (torch.randn(rows, n, device="cuda", generator=gen) * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(n, device="cuda", generator=gen)).to(dtype)
    want = fused_ops.rms_norm_eager(x, weight, 1e-6)
    got = fused_ops.rms_norm(x, weight, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    # The float32 mean of squares differs by its summation order (a few ulps of float32 over n <= 2^13 terms:
    # 2^-19 relative bounds it), then two roundings to the output dtype (the normalized value, the weight
    # product) can each move by one ulp.
    diff = (got.float() - want.float()).abs()
    bound = 2 * _ulp(want) + 2.0**-19 * want.float().abs() + 1e-30
    assert bool((diff <= bound).all()), f"max diff {diff.max().item()}"
    if dtype == torch.bfloat16:  # the scale's float32 ulps vanish in the cast on most elements (not in float32)
        assert (got == want).float().mean().item() > 0.9


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_sum_is_exact_and_norm_matches(dtype: torch.dtype) -> None:
    gen = _gen(11)
    x = torch.randn(16, 7168, device="cuda", generator=gen).to(dtype)
    delta = torch.randn(16, 7168, device="cuda", generator=gen).to(dtype)
    weight = torch.rand(7168, device="cuda", generator=gen).to(dtype)
    summed, normed = fused_ops.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(summed, x + delta)
    assert torch.equal(normed, fused_ops.rms_norm(x + delta, weight, 1e-6))


def test_norm_rows_are_batch_invariant_and_graph_replay_is_exact() -> None:
    gen = _gen(3)
    x = torch.randn(64, 7168, device="cuda", generator=gen).to(torch.bfloat16)
    weight = torch.rand(7168, device="cuda", generator=gen).to(torch.bfloat16)
    whole = fused_ops.rms_norm(x, weight, 1e-6)
    for r in (0, 17, 63):
        assert torch.equal(fused_ops.rms_norm(x[r : r + 1], weight, 1e-6), whole[r : r + 1])
    # The columns of a cache row: a strided input and output.
    rows = torch.zeros(64, 576, device="cuda", dtype=torch.bfloat16)
    kv_a = torch.randn(64, 576, device="cuda", generator=gen).to(torch.bfloat16)
    w512 = weight[:512].contiguous()
    fused_ops.rms_norm(kv_a[:, :512], w512, 1e-6, out=rows[:, :512])
    assert torch.equal(rows[:, :512], fused_ops.rms_norm(kv_a[:, :512].contiguous(), w512, 1e-6))
    assert bool((rows[:, 512:] == 0).all())
    static_in = x.clone()
    static_out = torch.empty_like(whole)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        static_out.copy_(fused_ops.rms_norm(static_in, weight, 1e-6))  # warm-up (compiles) off the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out.copy_(fused_ops.rms_norm(static_in, weight, 1e-6))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, whole)


def test_disabled_runs_eager() -> None:
    x = torch.randn(4, 512, device="cuda").to(torch.bfloat16)
    weight = torch.rand(512, device="cuda").to(torch.bfloat16)
    fused_ops.set_enabled(False)
    try:
        assert torch.equal(fused_ops.rms_norm(x, weight, 1e-6), fused_ops.rms_norm_eager(x, weight, 1e-6))
    finally:
        fused_ops.set_enabled(True)
    assert fused_ops.enabled()


def test_model_with_fused_ops_matches_eager() -> None:
    """tiny-dsa in bf16 on the GPU, the same weights and prompt, fused against eager: the prompt's logits stay
    within bf16 noise of each other (rope and the residual sums are exact, the norms' last bits differ) and their
    argmax agrees at almost every position (random weights leave near-ties, so not at all of them)."""
    from dsa_test_helpers import dense_backend, prefill_logits

    from decode_server.model import build_random_model, load_config

    config = load_config("tiny-dsa")
    model = build_random_model(config, "cuda", torch.bfloat16, seed=0)
    prompt = torch.randint(2, config.vocab_size, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    results = {}
    for fused in (True, False):
        fused_ops.set_enabled(fused)
        try:
            backend = dense_backend(config, num_slots=1024, max_requests=2, max_context=512, kv_dtype=torch.bfloat16,
                                    device="cuda")
            backend.reserve(0, len(prompt))
            results[fused] = prefill_logits(model, backend, prompt).float()
        finally:
            fused_ops.set_enabled(True)
    fused_logits, eager_logits = results[True], results[False]
    scale = eager_logits.abs().max().item()
    assert (fused_logits - eager_logits).abs().max().item() <= 0.05 * scale
    agree = (fused_logits.argmax(-1) == eager_logits.argmax(-1)).float().mean().item()
    assert agree >= 0.95, agree


def test_indexer_query_in_e4m3_scores_as_the_eager_float_query() -> None:
    """On CUDA the indexer's query and key chains run as one kernel each (kernels/indexer_rotation_triton.py) and
    hand the query on in e4m3 with the weights scaled to match; eager keeps float32 q and weights · weight_scale.
    The keys are the same bytes, the e4m3 query is eager's float query quantized (`quantize_query`), and the fp8
    scores kernel gives both forms the same bits, so the switch changes no selection."""
    from decode_server.model import build_random_model, load_config
    from kernels.indexer_fast import FastScoresConfig, indexer_scores_fast, quantize_query

    config = load_config("tiny-dsa")
    model = build_random_model(config, "cuda", torch.bfloat16, seed=0)
    indexer = model.model.layers[0].self_attn.indexer
    tokens = 37
    gen = _gen(11)
    x = torch.randn(tokens, config.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
    q_latent = torch.randn(tokens, config.q_lora_rank, device="cuda", generator=gen).to(torch.bfloat16)
    cos, sin = model.model.rotary(torch.arange(100, 100 + tokens, device="cuda"), torch.float32)
    outs = {}
    for fused in (True, False):
        fused_ops.set_enabled(fused)
        try:
            outs[fused] = indexer(x, q_latent, cos, sin)
        finally:
            fused_ops.set_enabled(True)
    on, off = outs[True], outs[False]
    assert on.q.dtype == torch.float8_e4m3fn and off.q.dtype == torch.float32
    assert torch.equal(on.keys_fp8.view(torch.uint8), off.keys_fp8.view(torch.uint8))
    assert torch.equal(on.key_scales, off.key_scales)
    want_q, want_w = quantize_query(off.q, off.weights, 1.0)
    assert torch.equal(on.q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(on.weights, want_w)
    token_rows = torch.arange(tokens, device="cuda", dtype=torch.int32).unsqueeze(0)
    token_req = torch.zeros(tokens, device="cuda", dtype=torch.int64)
    seq_lens = torch.arange(1, tokens + 1, device="cuda")
    fp8 = FastScoresConfig(precision="fp8")
    got = indexer_scores_fast(on.q, on.weights, on.keys_fp8, on.key_scales, token_rows, token_req, seq_lens, fp8)
    want = indexer_scores_fast(off.q, off.weights, off.keys_fp8, off.key_scales, token_rows, token_req, seq_lens,
                               fp8)
    for t in range(tokens):
        assert torch.equal(got[t, : t + 1], want[t, : t + 1]), t


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("tokens", "heads"), [(1, 64), (7, 32), (300, 8), (3, 5)])
def test_indexer_rotation_kernels_give_eagers_bits(dtype: torch.dtype, interleaved: bool, tokens: int,
                                                   heads: int) -> None:
    """The query chain (rotary + Hadamard, float32 out, and e4m3 out) and the key chain (rotary + Hadamard + FP8
    packing) against eager, bit for bit, on strided inputs (a column slice of a wider projection, as the fused
    input projection hands the keys over) and with angles of large positions."""
    from kernels import indexer_rotation_triton as k
    from kernels.indexer_fast import quantize_query
    from kernels.indexer_ref import quantize_index_keys

    gen = _gen(tokens * 7 + heads)
    q = (torch.randn(tokens, heads, 128, device="cuda", generator=gen) * 3).to(dtype)
    w = torch.randn(tokens, heads, device="cuda", generator=gen)
    wide = (torch.randn(tokens, 512 + 128, device="cuda", generator=gen) * 2).to(dtype)
    keys_in = wide[:, 512:].float() if dtype == torch.float32 else wide[:, 512:]
    angles = torch.rand(tokens, 32, device="cuda", generator=gen, dtype=torch.float64) * 1e5
    cos, sin = torch.cos(angles).float(), torch.sin(angles).float()
    want = fused_ops.rotate_index_heads(q, cos, sin, 64, interleaved)
    got, got_w = k.index_query(q, cos, sin, interleaved, w, 0.125 * 3, quantize=False)
    assert torch.equal(got, want) and torch.equal(got_w, w * (0.125 * 3))
    want8, want_w8 = quantize_query(want, w, 0.375)
    got8, got_w8 = k.index_query(q, cos, sin, interleaved, w, 0.375, quantize=True)
    assert torch.equal(got8.view(torch.uint8), want8.view(torch.uint8)) and torch.equal(got_w8, want_w8)
    want_keys, want_scales = quantize_index_keys(fused_ops.rotate_index_heads(keys_in, cos, sin, 64, interleaved))
    got_keys, got_scales = k.index_keys(keys_in, cos, sin, interleaved)
    assert torch.equal(got_keys.view(torch.uint8), want_keys.view(torch.uint8))
    assert torch.equal(got_scales, want_scales)


def _near_power_of_two_rows(rows: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """Random rows whose amax (per 128 columns) sits at, just above and just below 448 · 2^k: where the
    power-of-two scale's log2 / ceil decide between two exponents."""
    x = torch.randn(rows, width, device="cuda", generator=gen) * 3
    tiles = x.view(rows, -1, 128)
    k = torch.randint(-12, 4, (rows, tiles.shape[1]), device="cuda", generator=gen).float()
    base = 448.0 * torch.exp2(k)
    nudge = torch.tensor([1.0, 1 + 2**-23, 1 + 2**-22, 1 - 2**-24, 1 + 2**-20, 1.5], device="cuda")
    pick = torch.randint(0, nudge.numel(), (rows, tiles.shape[1]), device="cuda", generator=gen)
    tiles[..., 0] = base * nudge[pick]
    tiles[..., 1:] = tiles[..., 1:].clamp(-0.9, 0.9) * base.unsqueeze(-1)
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_index_key_quantization_gives_eagers_bits(dtype: torch.dtype, rows: int) -> None:
    from kernels.indexer_ref import quantize_index_keys

    gen = _gen(rows + 5)
    for keys in (torch.randn(rows, 128, device="cuda", generator=gen) * 7, _near_power_of_two_rows(rows, 128, gen)):
        keys = keys.to(dtype)
        if rows > 1:
            keys[0] = 0  # an all-zero key: the 1e-4 floor
        want_q, want_s = quantize_index_keys(keys)
        got_q, got_s = fused_ops.quantize_index_keys(keys)
        assert got_q.dtype == torch.float8_e4m3fn and got_s.dtype == torch.float32
        assert torch.equal(got_s, want_s)
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 257])
def test_fp8_row_packing_gives_eagers_bytes(dtype: torch.dtype, rows: int) -> None:
    from kernels.fp8_rows import pack_fp8_rows

    gen = _gen(rows + 9)
    for x in (torch.randn(rows, 576, device="cuda", generator=gen) * 5, _near_power_of_two_rows(rows, 640, gen)):
        x = x[:, :576].to(dtype)  # a strided view for the second (a slice of wider rows)
        assert torch.equal(fused_ops.pack_fp8_rows(x), pack_fp8_rows(x))
    # Rows of one batch do not depend on each other; a graph replay gives the launch's bytes.
    x = torch.randn(rows, 576, device="cuda", generator=gen).to(dtype)
    whole = fused_ops.pack_fp8_rows(x)
    assert torch.equal(fused_ops.pack_fp8_rows(x[-1:]), whole[-1:])
    out = torch.empty_like(whole)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(fused_ops.pack_fp8_rows(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, whole)


def _swiglu_inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up as column halves of one [..., 2n] tensor (strided rows, as the stacked gate/up GEMM gives them):
    randn · 8, the first row's first values the extremes (exp(100) overflows, silu(-100) = -0; ±88.5 near expf's
    overflow; float32 subnormals; ±0)."""
    n = shape[-1]
    both = torch.randn(*shape[:-1], 2 * n, device="cuda", generator=_gen(seed)) * 8
    extremes = torch.tensor([-100.0, 100.0, -88.5, 88.5, -20.0, 1e-39, -3e-39, 0.0, -0.0, 1e-30], device="cuda")
    first = both[(0,) * (both.dim() - 1)]
    first[: min(n, extremes.numel())] = extremes[:n]
    both = both.to(dtype)
    return both[..., :n], both[..., n:]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2048), (64, 2304), (1, 18432), (512, 256), (7, 1000), (3, 5, 333), (9,)])
def test_silu_mul_gives_eagers_bits(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """[1, 2048] / [64, 2304]: the dense MLP's intermediate at TP 1 / TP 8 (18432 / 8), [512, 256]: the routed
    experts' rows at TP 8; then widths that are no multiple of the kernel's block, 3-D and 1-D inputs."""
    gate, up = _swiglu_inputs(shape, dtype, seed=sum(shape))
    from kernels import swiglu_triton

    assert swiglu_triton.supports(gate, up)  # the kernel runs, not the eager fallback
    want = F.silu(gate) * up
    got = fused_ops.silu_mul(gate, up)
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got, want)
    assert torch.equal(got.view(-1).signbit(), want.view(-1).signbit())  # -0 where eager has -0
    assert torch.equal(fused_ops.silu_mul(gate.contiguous(), up.contiguous()), want)
    # A CUDA-graph replay reads the inputs of the replay, with the same bits.
    static_gate, static_up = gate.clone(), up.clone()
    out = torch.empty_like(want)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out.copy_(fused_ops.silu_mul(static_gate, static_up))  # warm-up (compiles) off the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(fused_ops.silu_mul(static_gate, static_up))
    new_gate, new_up = _swiglu_inputs(shape, dtype, seed=sum(shape) + 1)
    static_gate.copy_(new_gate)
    static_up.copy_(new_up)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, F.silu(new_gate) * new_up)


def test_mlp_and_grouped_experts_give_the_same_bits_with_the_swiglu_kernel() -> None:
    """The dense MLP (gate and up stacked: strided halves) and the MoE's grouped experts (torch._grouped_mm's
    outputs), bf16, with fused ops on and off: only silu · up changes between the two, with the same bits."""
    from decode_server.model import load_config
    from decode_server.model.layers import MLP
    from decode_server.model.moe import MoE

    torch.manual_seed(0)
    mlp = MLP(256, 512).to(device="cuda", dtype=torch.bfloat16)
    mlp.fuse_gate_up(copy=True)
    assert mlp.fused_gate_up is not None
    moe = MoE(load_config("tiny-dsa"))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=0.05)
    moe = moe.to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(33, 256, device="cuda", generator=_gen(11)).to(torch.bfloat16)
    xm = torch.randn(17, moe.experts[0].gate_proj.in_features, device="cuda", generator=_gen(12)).to(torch.bfloat16)
    results = {}
    for fused in (True, False):
        fused_ops.set_enabled(fused)
        try:
            with torch.inference_mode():
                weights, ids = moe.gate(xm) if fused else results[True][2]
                results[fused] = (mlp(x), moe.routed_grouped(xm, weights, ids), (weights, ids))
        finally:
            fused_ops.set_enabled(True)
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("n", [7168, 1536])
def test_norm_fp8_output_is_the_quantization_kernels_bits(rows: int, n: int) -> None:
    """`quantize=True` (the norm before an FP8 GEMM that reads quantized activations): the normed values are the
    plain kernel's and the attached e4m3 values and scales are `quantize_activations`' of them, bit for bit, for
    the norm and the residual add + norm; under a CUDA-graph replay too."""
    from kernels.fp8_gemm import attached_quantized
    from kernels.fp8_gemm_triton import quantize_activations

    x = (torch.randn(rows, n, device="cuda", generator=_gen(21)) * 3).to(torch.bfloat16)
    delta = torch.randn(rows, n, device="cuda", generator=_gen(22)).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(n, device="cuda", generator=_gen(23))).to(torch.bfloat16)

    def same_form(normed: torch.Tensor) -> None:
        attached = attached_quantized(normed)
        assert attached is not None
        want_q, want_s = quantize_activations(normed)
        assert torch.equal(attached[0].view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(attached[1], want_s)

    normed = fused_ops.rms_norm(x, weight, 1e-6, quantize=True)
    assert torch.equal(normed, fused_ops.rms_norm(x, weight, 1e-6))
    same_form(normed)
    summed, normed = fused_ops.add_rms_norm(x, delta, weight, 1e-6, quantize=True)
    assert torch.equal(summed, x + delta)
    assert torch.equal(normed, fused_ops.rms_norm(x + delta, weight, 1e-6))
    same_form(normed)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fused_ops.rms_norm(x, weight, 1e-6, quantize=True)
    x.copy_((torch.randn(rows, n, device="cuda", generator=_gen(24)) * 5).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, fused_ops.rms_norm(x, weight, 1e-6))
    same_form(replayed)


def test_fp8_model_gives_the_same_bits_with_the_norms_fp8_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode-sized forward of tiny-dsa with FP8 weights where the GEMMs after the norms pick a kernel that reads
    quantized activations: with the norms writing that form (decode_server/model/model.py `_reads_quantized`) the
    logits are the same bits as without, and each such norm spares one quantization launch. The shared expert
    stays a dense MLP here (fusion off): fused into the routed experts' GEMMs it reads the dispatched rows, not the
    norm's output, so the MoE's norm has no FP8 consumer (`MoE.fp8_input_shape` None)."""
    from dsa_test_helpers import dense_backend, prefill_logits

    import decode_server.model.model as model_module
    from decode_server.model import build_random_model, load_config
    from decode_server.model.moe import set_shared_experts_fusion
    from kernels import fp8_gemm, fp8_gemm_triton
    from kernels.fp8_gemm import GemmChoice

    config = load_config("tiny-dsa")
    fp8_gemm.reset_tuner("measure")  # tiny-dsa's shapes are in no table: measured, so its projections are stacked
    set_shared_experts_fusion(False)
    try:
        model = build_random_model(config, "cuda", torch.bfloat16, seed=0, quantization="fp8")
        layers = model.model.layers
        shapes = {layer.self_attn.fp8_input_shape() for layer in layers} | {layer.mlp.fp8_input_shape()
                                                                            for layer in layers}
        assert None not in shapes
        tuner = fp8_gemm.tuner()
        for n, k in shapes:  # the one-row kernel reading quantized activations, as the H100/H200 tables pick it
            tuner._choices[("dense", n, k, 0, 1, torch.bfloat16, torch.cuda.current_device(), (128, 128))] = \
                GemmChoice("triton", fp8_gemm_triton.TritonGemmConfig(block_n=16, gemv_groups=4, gemv_stages=3))
        prompt = [5]  # one token: one row, the bucket forced above
        calls = {"n": 0}
        quantize = fp8_gemm_triton.quantize_activations

        def counted(*args, **kwargs):
            calls["n"] += 1
            return quantize(*args, **kwargs)

        def logits() -> torch.Tensor:
            backend = dense_backend(config, num_slots=64, max_requests=2, max_context=64, kv_dtype=torch.bfloat16,
                                    device="cuda")
            backend.reserve(0, len(prompt))
            return prefill_logits(model, backend, prompt)

        logits()  # the other projections' measurements happen here, not in the counted runs
        monkeypatch.setattr(fp8_gemm_triton, "quantize_activations", counted)
        results, launches = {}, {}
        for spared in (True, False):
            if not spared:
                monkeypatch.setattr(model_module, "reads_quantized_input", lambda *args, **kwargs: False)
            calls["n"] = 0
            results[spared] = logits()
            launches[spared] = calls["n"]
        assert torch.equal(results[True], results[False])
        assert launches[False] - launches[True] == 2 * len(layers), launches
    finally:
        fp8_gemm.reset_tuner()
        set_shared_experts_fusion(True)
