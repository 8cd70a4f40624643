"""Block-FP8 GEMMs on the GPU (kernels/fp8_gemm*.py) against the references of kernels/fp8_gemm_ref.py.

Tolerances, for an output y[m, n] = Σ_k x[m, k]·W[n, k] (W exact in both: block FP8 dequantized):
  - against the reference with the same activation rounding (`fp8_linear_ref`, float32): the kernels differ only by
    summation and output rounding: |Δ| ≤ 2⁻⁸·|y| (bf16 output, round to nearest: 2⁻⁹, doubled) + 2⁻¹²·Σ_k|x_q||W|
    (Hopper's FP8 tensor cores accumulate one 128-deep tile with ~14 mantissa bits before the scales are applied in
    float32 — DeepSeek-V3's report — so ≤ 2⁻¹⁴ of the tile's Σ|terms| per tile, taken with 4× margin);
  - against the unrounded reference (x exact): that plus the activation-rounding bound `activation_rounding_bound`
    (e4m3 keeps 3 mantissa bits: each x within max(2⁻⁴·|x|, 2⁻¹⁰·s_group) of itself, summed with |W|).
Every Triton configuration the autotuner may pick for a shape is checked (`triton_candidates`), and scaled_mm where
the device supports it. Plus: quantization kernel = reference, the grouped GEMM with empty experts and other
ranks' rows, the autotuner (deterministic choice, forced backends, its timing as graph replays in turns), CUDA-graph
capture (replay = eager, also for a shape first met during capture), batch-invariant tiles.

Run: pytest -m gpu tests/kernels/test_fp8_gemm_gpu.py -v -s
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import pytest
import torch

from decode_server.model.fp8 import dequantize_block_fp8, quantize_block_fp8
from kernels import fp8_gemm
from kernels.fp8_gemm_ref import (
    activation_rounding_bound,
    dequantize_activations_ref,
    dequantize_weight_ref,
    fp8_bmm_ref,
    fp8_grouped_ref,
    fp8_linear_ref,
    quantize_activations_ref,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BLOCK = (128, 128)
# DeepSeek-V3.2 projections (q_b, kv_a's ragged 576 rows, o_proj, wk, the dense MLP's down, a shared expert) and a
# shape ragged in both dimensions.
SHAPES = {"q_b": (24576, 1536), "kv_a": (576, 7168), "o_proj": (7168, 16384), "wk": (128, 7168),
          "mlp_down": (7168, 18432), "shared_up": (2048, 7168), "ragged": (200, 320)}
TOKENS = [1, 16, 64, 256]


@pytest.fixture(autouse=True)
def _exact_float32_matmul():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 references must be float32
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@functools.cache
def weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block-FP8 weight whose blocks differ in magnitude by 10³ (a wrong block scale shows), its scales, and
    |dequantized| (for the tolerances)."""
    gen = torch.Generator(device="cuda").manual_seed(n * 7 + k)
    w = torch.randn(n, k, device="cuda", generator=gen) * torch.logspace(-2, 1, n, device="cuda")[:, None] * k**-0.5
    q, s = quantize_block_fp8(w)
    return q, s, dequantize_block_fp8(q, s).abs()


def activations(m: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed * 1000 + m + k)
    spread = torch.logspace(-3, 1, k, device="cuda")[torch.randperm(k, device="cuda", generator=gen)]
    return (torch.randn(m, k, device="cuda", generator=gen) * spread).to(torch.bfloat16)


def tolerance(x: torch.Tensor, wabs: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    xq = dequantize_activations_ref(*quantize_activations_ref(x)).abs()
    return 2.0**-8 * ref.abs() + 2.0**-12 * (xq @ wabs.t()) + 1e-30


def worst(err: torch.Tensor, tol: torch.Tensor) -> float:
    return float((err / tol).max())


@pytest.mark.parametrize(("m", "k", "pad"), [(1, 7168, 4), (3, 18432, 1), (64, 1536, 4), (257, 100, 4),
                                             (5, 128, 1)])
def test_quantization_kernel_equals_the_reference(m: int, k: int, pad: int) -> None:
    from kernels.fp8_gemm_triton import quantize_activations

    for dtype in (torch.bfloat16, torch.float32):
        x = activations(m, k).to(dtype)
        x[m // 2] = 0
        q, scales = quantize_activations(x, pad_rows_to=pad)
        q_ref, s_ref = quantize_activations_ref(x)
        m_pad = -(-m // pad) * pad
        assert q.shape == (m_pad, k) and scales.shape == (s_ref.shape[1], m_pad)
        assert torch.equal(q[:m].float(), q_ref.float())  # ±0 aside, the same bits
        assert torch.equal(scales[:, :m].t(), s_ref)
        assert not q[m:].float().any()


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_dense_backends_against_the_references(shape: str, m: int) -> None:
    n, k = SHAPES[shape]
    w, s, wabs = weight(n, k)
    x = activations(m, k)
    ref = fp8_linear_ref(x, w, s)
    tol = tolerance(x, wabs, ref)
    exact = fp8_linear_ref(x, w, s, quantize_input=False)
    tol_exact = tol + activation_rounding_bound(x, w, s)
    device = x.device
    choices = fp8_gemm.triton_candidates("dense", fp8_gemm.m_bucket(m), n, k, 0, device)
    if fp8_gemm.scaled_mm_supported(n, k, BLOCK, device):
        choices.insert(0, fp8_gemm.GemmChoice("scaled_mm"))
    failures, report = [], []
    for choice in choices:
        try:
            out = fp8_gemm._run_dense(choice, x, w, s, BLOCK, torch.bfloat16)
        except Exception as exc:  # noqa: BLE001 - collected: every configuration is reported
            failures.append(f"{choice.label()}: raised {type(exc).__name__}: {exc}")
            continue
        assert out.shape == (m, n) and out.dtype == torch.bfloat16
        err = (out.float() - ref).abs()
        ratio, ratio_exact = worst(err, tol), worst((out.float() - exact).abs(), tol_exact)
        report.append(f"{choice.label()}: err/tol {ratio:.3f}, vs exact {ratio_exact:.3f}")
        if not (ratio <= 1 and ratio_exact <= 1):
            failures.append(f"{choice.label()}: err/tol {ratio:.3g} (exact: {ratio_exact:.3g})")
    print(f"\n{shape} N={n} K={k} M={m}: " + "; ".join(report))
    assert not failures, failures


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize(("n", "k"), [(2048, 7168), (7168, 2048)])
@pytest.mark.parametrize("local", [32, 24], ids=["all-local", "ep-24-of-32"])
def test_grouped_kernel_against_the_reference(n: int, k: int, tokens: int, local: int) -> None:
    """32 experts, top-8 per token; with expert parallelism only `local` are this rank's: the others' rows sort
    last (past the last offset) and are not computed."""
    experts, top_k = 32, 8
    gen = torch.Generator(device="cuda").manual_seed(tokens + n)
    # One cached block-varying FP8 weight for every expert, each with its own scales (a wrong expert shows).
    base_w, base_s, _ = weight(n, k)
    w = base_w.unsqueeze(0).repeat(local, 1, 1)
    s = base_s.unsqueeze(0) * torch.rand(local, 1, 1, device="cuda", generator=gen).add(0.5)
    ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=-1).indices.flatten()
    ids = torch.where(ids < local, ids, local)  # the sentinel of other ranks' experts
    sorted_ids, order = torch.sort(ids, stable=True)
    ends = torch.searchsorted(sorted_ids, torch.arange(local, device="cuda"), right=True).to(torch.int32)
    x = activations(tokens, k)[order // top_k]
    ref = fp8_grouped_ref(x, w, s, ends)
    rows = int(ends[-1])
    xq = dequantize_activations_ref(*quantize_activations_ref(x)).abs()
    wabs = dequantize_weight_ref(w, s, BLOCK).abs()
    tol = torch.zeros_like(ref)
    start = 0
    for e, end in enumerate(ends.tolist()):
        tol[start:end] = 2.0**-8 * ref[start:end].abs() + 2.0**-12 * (xq[start:end] @ wabs[e].t())
        start = end
    tol += 1e-30
    failures, report = [], []
    bucket = fp8_gemm.m_bucket(x.shape[0])
    for choice in fp8_gemm.triton_candidates("grouped", bucket, n, k, local, x.device):
        out = fp8_gemm._run_grouped(choice, x, w, s, ends, BLOCK, torch.bfloat16)
        ratio = worst((out[:rows].float() - ref[:rows]).abs(), tol[:rows])
        report.append(f"{choice.label()}: {ratio:.3f}")
        if not ratio <= 1:
            failures.append(f"{choice.label()}: err/tol {ratio:.3g}")
    print(f"\ngrouped N={n} K={k} tokens={tokens} local experts={local} rows={rows}/{x.shape[0]}: "
          + "; ".join(report))
    assert not failures, failures


def test_tuner_choice_is_measured_cached_and_deterministic(caplog) -> None:
    tuner = fp8_gemm.reset_tuner("measure")
    w, s, _ = weight(*SHAPES["q_b"])
    x = activations(1, SHAPES["q_b"][1])
    with caplog.at_level(logging.INFO, logger="kernels.fp8_gemm"):
        first = fp8_gemm.fp8_linear(x, w, s)
    record = tuner.records[-1]
    print(f"\nq_b M=1: chose {record.choice.label()}; µs {record.timings_us}; rejected {record.rejected}")
    assert record.timings_us and record.choice.label() in record.timings_us
    assert any(label.startswith("triton") for label in record.timings_us)
    if fp8_gemm.scaled_mm_supported(*SHAPES["q_b"], BLOCK, x.device):
        assert "scaled_mm" in record.timings_us or record.rejected, "scaled_mm was neither timed nor rejected"
    assert "FP8 GEMM dense N=24576 K=1536 M≤1" in caplog.text
    for _ in range(3):
        assert torch.equal(fp8_gemm.fp8_linear(x, w, s), first)
    assert len(tuner.records) == 1  # cached: no second measurement


def test_candidates_are_timed_as_graph_replays_in_turns() -> None:
    """`_time_us`: a fn whose calls cannot be captured gets NaN, first or second, and the other still times (a
    failed capture must leave the stream, the allocator and the next capture sound); 4× the work times slower than
    1×; and the tuner's time for its choice of kv_a at M 64 is what an independent graph replay of that choice
    measures (eager timing read such shapes ~3× too high on an H100)."""
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.current_stream()

    def capturable(i: int) -> torch.Tensor:
        return a @ a

    def item(i: int) -> float:
        return float((a @ a).sum().item())

    def synchronizes(i: int) -> torch.Tensor:
        y = a @ a
        torch.cuda.synchronize()
        return y

    times = fp8_gemm._time_us([item, capturable], 4)
    assert math.isnan(times[0]) and math.isfinite(times[1]) and times[1] > 0, times
    assert torch.cuda.current_stream() == stream  # a failed capture's stream is not left current
    times = fp8_gemm._time_us([capturable, synchronizes], 4)
    assert math.isfinite(times[0]) and math.isnan(times[1]), times
    assert torch.cuda.current_stream() == stream
    assert math.isfinite(fp8_gemm._time_us([capturable], 4)[0])

    def four(i: int) -> list[torch.Tensor]:
        return [a @ a for _ in range(4)]

    t4, t1 = fp8_gemm._time_us([four, capturable], 4)
    print(f"\n1× {t1:.1f} µs, 4× {t4:.1f} µs")
    assert 2 * t1 < t4 < 8 * t1

    n, k = SHAPES["kv_a"]
    device = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(3)
    weights = [fp8_gemm._random_weights((n, k), BLOCK, device, gen)]
    tuner = fp8_gemm.reset_tuner("measure")
    try:
        choice = fp8_gemm.tune("dense", weights, 64, torch.bfloat16)
        record = tuner.records[-1]
    finally:
        fp8_gemm.reset_tuner()
    assert record.best_us is not None, record
    assert not [r for r in record.rejected if "CUDA graph" in r], record.rejected
    # Independently: 20 calls of the choice in one graph, weights rotated over copies exceeding twice the L2.
    per_weight = n * k + 4 * weights[0][1].numel()
    while len(weights) * per_weight <= 2 * fp8_gemm._l2_bytes(torch.cuda.current_device()):
        weights.append(fp8_gemm._random_weights((n, k), BLOCK, device, gen))
    x = activations(64, k)
    calls = 20
    side = torch.cuda.Stream()
    side.wait_stream(stream)
    with torch.cuda.stream(side):
        fp8_gemm._run_dense(choice, x, *weights[0], BLOCK, torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        for i in range(calls):
            fp8_gemm._run_dense(choice, x, *weights[i % len(weights)], BLOCK, torch.bfloat16)
    graph.replay()
    replays = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        replays.append(start.elapsed_time(end) * 1000.0 / calls)
    del graph
    independent = min(replays)
    print(f"kv_a M 64: chose {choice.label()}, tuner {record.best_us:.1f} µs, graph replay {independent:.1f} µs; "
          f"{record.timings_us}")
    assert 0.67 <= record.best_us / independent <= 1.5


@pytest.mark.parametrize("backend", ["triton", "scaled_mm"])
def test_forced_backend(backend: str) -> None:
    n, k = SHAPES["shared_up"]
    w, s, wabs = weight(n, k)
    x = activations(16, k)
    tuner = fp8_gemm.reset_tuner("measure")
    with fp8_gemm.force_backend(backend):
        out = fp8_gemm.fp8_linear(x, w, s)
    record = tuner.records[-1]
    if backend == "scaled_mm" and not fp8_gemm.scaled_mm_supported(n, k, BLOCK, x.device):
        assert record.choice.backend == "triton"
        pytest.skip("torch._scaled_mm block scaling is not offered on this device (SM90 only)")
    if backend == "scaled_mm" and record.rejected:
        pytest.fail(f"scaled_mm rejected on this device: {record.rejected}")
    assert record.choice.backend == backend, record
    ref = fp8_linear_ref(x, w, s)
    assert worst((out.float() - ref).abs(), tolerance(x, wabs, ref)) <= 1


def test_cuda_graph_replay_equals_eager_even_for_a_shape_first_met_in_capture(caplog) -> None:
    fp8_gemm.reset_tuner("measure")
    n, k = SHAPES["q_b"]
    w, s, _ = weight(n, k)
    gw = weight(2048, 7168)
    gate = (gw[0].unsqueeze(0).repeat(4, 1, 1), gw[1].unsqueeze(0).repeat(4, 1, 1))
    x = activations(16, k)
    xg = activations(32, 7168)
    ends = torch.tensor([8, 8, 20, 32], dtype=torch.int32, device="cuda")
    eager = fp8_gemm.fp8_linear(x, w, s), fp8_gemm.fp8_grouped_linear(xg, *gate, ends)  # tuned here, eagerly
    fresh = weight(576, 7168)
    x_fresh = activations(16, 7168)
    # Compile the default kernel the capture will fall back to (as the engine's eager warm-up runs do), without
    # letting the tuner see the shape.
    default = fp8_gemm.default_choice("dense", 16, 576, 7168, 0, x.device)
    fp8_gemm._run_dense(default, x_fresh, fresh[0], fresh[1], BLOCK, torch.bfloat16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with caplog.at_level(logging.WARNING, logger="kernels.fp8_gemm"), torch.cuda.graph(graph, stream=stream):
        outputs = (fp8_gemm.fp8_linear(x, w, s), fp8_gemm.fp8_grouped_linear(xg, *gate, ends),
                   fp8_gemm.fp8_linear(x_fresh, fresh[0], fresh[1]))  # N=576 never tuned: default, untimed
    assert "first met during CUDA-graph capture" in caplog.text
    x.copy_(activations(16, k, seed=1))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(outputs[0], fp8_gemm.fp8_linear(x, w, s))
    assert torch.equal(outputs[1][:32], eager[1][:32])
    assert torch.equal(outputs[2], fp8_gemm.fp8_linear(x_fresh, fresh[0], fresh[1]))


def test_batch_invariant_tiles_make_a_row_independent_of_its_batch() -> None:
    from decode_server.model.batch_invariant import batch_invariant_mode, fp8_linear

    w, s, _ = weight(*SHAPES["shared_up"])
    rows = activations(100, SHAPES["shared_up"][1])
    with batch_invariant_mode():
        batched = fp8_linear(rows, w, s)
        alone = torch.cat([fp8_linear(rows[i : i + 1], w, s) for i in (0, 37, 99)])
    assert torch.equal(batched[[0, 37, 99]], alone)


FUSED_CASES = [("kv_a", 1, 8), ("wk", 1, 16), ("q_b", 4, 1), ("o_proj", 16, 8), ("ragged", 3, 2)]


@pytest.mark.parametrize(("shape", "m", "split_k"), FUSED_CASES)
def test_fused_quantization_and_reduction_give_the_unfused_bits(shape: str, m: int, split_k: int) -> None:
    """The fused variants (quantization and the split-K sum inside the GEMM) compute the same products and sum the
    splits in the same order as quantize → GEMM → sum kernel: the same bits, at every call (a late partial, a lost
    ticket or a counter left non-zero by the previous call would show as a different value). Also under a CUDA
    graph, replayed several times against eager calls."""
    from kernels import fp8_gemm_triton as tri

    n, k = SHAPES[shape]
    w, s, _ = weight(n, k)
    x = activations(m, k)
    base = tri.TritonGemmConfig(16, 64, split_k)
    q, scales = tri.quantize_activations(x)
    want = tri.fp8_gemm(q, scales, m, w, s, torch.bfloat16, base)
    fused = tri.TritonGemmConfig(16, 64, split_k, fuse_quant=True, fuse_reduce=True)
    for _ in range(20):
        assert torch.equal(tri.fp8_gemm(x, None, m, w, s, torch.bfloat16, fused), want)
    reduce_only = tri.TritonGemmConfig(16, 64, split_k, fuse_reduce=True)
    assert torch.equal(tri.fp8_gemm(q, scales, m, w, s, torch.bfloat16, reduce_only), want)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=stream):
        captured = tri.fp8_gemm(x, None, m, w, s, torch.bfloat16, fused)
    for seed in range(1, 4):
        x.copy_(activations(m, k, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        q, scales = tri.quantize_activations(x)
        assert torch.equal(captured, tri.fp8_gemm(q, scales, m, w, s, torch.bfloat16, base))
    assert not any(int(t.abs().sum()) for t in tri._counters.values()), "tile counters left non-zero"


@pytest.mark.parametrize("shape", ["kv_a", "q_b", "o_proj", "ragged"])
def test_gemv_quantizing_inside_gives_the_quantization_kernels_bits(shape: str) -> None:
    """The one-row kernel with the quantization inside gives the bits of the kernel reading the quantization
    kernel's output (the same values, the same products), for every launch shape the tuner may pick; also under a
    CUDA graph replayed on new inputs."""
    from kernels import fp8_gemm_triton as tri

    n, k = SHAPES[shape]
    w, s, _ = weight(n, k)
    x = activations(1, k)
    for block_n, groups, warps, _fused, stages in fp8_gemm.GEMV_CANDIDATES:
        plain = tri.TritonGemmConfig(block_n=block_n, num_warps=warps, gemv_groups=groups, gemv_stages=stages)
        fused = tri.TritonGemmConfig(block_n=block_n, num_warps=warps, gemv_groups=groups, gemv_stages=stages,
                                     fuse_quant=True)
        q, scales = tri.quantize_activations(x)
        want = tri.fp8_gemv(q, scales, 1, w, s, torch.bfloat16, plain)
        assert torch.equal(tri.fp8_gemv(x, None, 1, w, s, torch.bfloat16, fused), want), fused.label()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=stream):
        captured = tri.fp8_gemv(x, None, 1, w, s, torch.bfloat16, fused)
    for seed in range(1, 4):
        x.copy_(activations(1, k, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        q, scales = tri.quantize_activations(x)
        assert torch.equal(captured, tri.fp8_gemv(q, scales, 1, w, s, torch.bfloat16, plain))


@pytest.mark.parametrize("tokens", [1, 3])
def test_grouped_gemv_quantizing_inside_gives_the_quantization_kernels_bits(tokens: int) -> None:
    """The grouped one-row kernel, decode-like (top-8 of 32 experts for 1 or 3 tokens: some experts get two or
    three rows, others none), quantizing inside against reading the quantization kernel's output: the same bits
    for every launch shape the tuner may pick, in both launch forms (a program per expert, a program per row),
    and under a CUDA graph replayed on new rows."""
    from kernels import fp8_gemm_triton as tri

    n, k, experts, top_k = 2048, 7168, 32, 8
    base_w, base_s, _ = weight(n, k)
    w = base_w.unsqueeze(0).repeat(experts, 1, 1)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    s = base_s.unsqueeze(0) * torch.rand(experts, 1, 1, device="cuda", generator=gen).add(0.5)
    ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=-1).indices.flatten()
    sorted_ids, order = torch.sort(ids, stable=True)
    ends = torch.searchsorted(sorted_ids, torch.arange(experts, device="cuda"), right=True).to(torch.int32)
    x = activations(tokens, k)[order // top_k]
    for block_n, groups, warps, _fused, stages in fp8_gemm.GROUPED_GEMV_CANDIDATES:
        plain = tri.TritonGemmConfig(block_n=block_n, num_warps=warps, gemv_groups=groups, gemv_stages=stages)
        fused = tri.TritonGemmConfig(block_n=block_n, num_warps=warps, gemv_groups=groups, gemv_stages=stages,
                                     fuse_quant=True)
        q, scales = tri.quantize_activations(x)
        want = tri.fp8_grouped_gemv(q, scales, w, s, ends, torch.bfloat16, plain)
        assert torch.equal(tri.fp8_grouped_gemv(x, None, w, s, ends, torch.bfloat16, fused), want), fused.label()
    for block_n, groups, warps, fused_quant, stages in fp8_gemm.GROUPED_GEMV_ROW_CANDIDATES:
        per_expert = tri.TritonGemmConfig(block_n=block_n, num_warps=warps, gemv_groups=groups)
        by_row = tri.TritonGemmConfig(block_n=block_n, num_warps=warps, gemv_groups=groups, gemv_stages=stages,
                                      fuse_quant=fused_quant, gemv_row_programs=True)
        q, scales = tri.quantize_activations(x)
        want = tri.fp8_grouped_gemv(q, scales, w, s, ends, torch.bfloat16, per_expert)
        got = tri.fp8_grouped_gemv(*((x, None) if fused_quant else (q, scales)), w, s, ends, torch.bfloat16, by_row)
        assert torch.equal(got, want), by_row.label()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=stream):
        captured = tri.fp8_grouped_gemv(x, None, w, s, ends, torch.bfloat16, fused)
    for seed in range(1, 4):
        x.copy_(activations(tokens, k, seed=seed)[order // top_k])
        graph.replay()
        torch.cuda.synchronize()
        q, scales = tri.quantize_activations(x)
        assert torch.equal(captured, tri.fp8_grouped_gemv(q, scales, w, s, ends, torch.bfloat16, plain))


@pytest.mark.parametrize("tokens", [1, 2, 4])
def test_fused_grouped_gemm_gives_the_unfused_bits(tokens: int) -> None:
    """The grouped kernel's fused variant (per (expert, row tile) counters) against the unfused one, with
    experts that get no rows and rows of other ranks past the last offset."""
    from kernels import fp8_gemm_triton as tri

    experts, top_k, n, k = 32, 8, 2048, 7168
    base_w, base_s, _ = weight(n, k)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    w = base_w.unsqueeze(0).repeat(experts, 1, 1)
    s = base_s.unsqueeze(0) * torch.rand(experts, 1, 1, device="cuda", generator=gen).add(0.5)
    ids = torch.rand(tokens, 40, device="cuda", generator=gen).topk(top_k, dim=-1).indices.flatten()
    ids = torch.where(ids < experts, ids, experts)
    sorted_ids, order = torch.sort(ids, stable=True)
    ends = torch.searchsorted(sorted_ids, torch.arange(experts, device="cuda"), right=True).to(torch.int32)
    x = activations(tokens, k)[order // top_k]
    rows = int(ends[-1])
    for split_k in (1, 4, 8):
        base = tri.TritonGemmConfig(16, 64, split_k)
        q, scales = tri.quantize_activations(x)
        want = tri.fp8_grouped_gemm(q, scales, w, s, ends, torch.bfloat16, base)[:rows]
        fused = tri.TritonGemmConfig(16, 64, split_k, fuse_quant=True, fuse_reduce=True)
        for _ in range(10):
            assert torch.equal(tri.fp8_grouped_gemm(x, None, w, s, ends, torch.bfloat16, fused)[:rows], want)
    assert not any(int(t.abs().sum()) for t in tri._counters.values()), "tile counters left non-zero"


@pytest.mark.parametrize("tokens", [16, 42, 64])
def test_grouped_launch_order_stages_and_register_cap_keep_the_bits(tokens: int) -> None:
    """Decode routing of a rank (top-8 of 32 routed experts plus a fused shared expert, the last, with a row of
    every token): the last expert's programs first, 3 stages and a 128-register cap change only when and where
    programs run, so each gives the bits of the plain launch of its tile (tuned tables pick any of them)."""
    from kernels import fp8_gemm_triton as tri

    routed, top_k, n, k = 32, 8, 4096, 2048
    base_w, base_s, _ = weight(n, k)
    gen = torch.Generator(device="cuda").manual_seed(100 + tokens)
    w = base_w.unsqueeze(0).repeat(routed + 1, 1, 1)
    s = base_s.unsqueeze(0) * torch.rand(routed + 1, 1, 1, device="cuda", generator=gen).add(0.5)
    picked = torch.rand(tokens, routed, device="cuda", generator=gen).topk(top_k, dim=-1).indices
    ids = torch.cat([picked, torch.full((tokens, 1), routed, device="cuda")], dim=1).flatten()
    sorted_ids, order = torch.sort(ids, stable=True)
    ends = torch.searchsorted(sorted_ids, torch.arange(routed + 1, device="cuda"), right=True).to(torch.int32)
    x = activations(tokens, k)[order // (top_k + 1)]
    q, scales = tri.quantize_activations(x)
    for block_m, m_programs in ((16, 1), (16, 2), (64, 1)):
        plain = tri.TritonGemmConfig(block_m, 64, 1, m_programs=m_programs)
        want = tri.fp8_grouped_gemm(q, scales, w, s, ends, torch.bfloat16, plain)
        for variant in (dataclasses.replace(plain, experts_reversed=True), dataclasses.replace(plain, num_stages=3),
                        dataclasses.replace(plain, num_stages=3, max_registers=128, experts_reversed=True)):
            got = tri.fp8_grouped_gemm(q, scales, w, s, ends, torch.bfloat16, variant)
            assert torch.equal(got, want), variant.label()


# -- the batched kernel: MLA's absorbed products with FP8 weights (kernels/fp8_bmm_triton.py) ----------------------

HEADS, NOPE, ROPE, LORA, V = 128, 128, 64, 512, 128  # DeepSeek-V3.2 at TP1


def absorbed_operands(product: str, tokens: int, seed: int = 0):
    """(a [H, T, K], w [H, N, K], scales, out [H, T, N], the tensor out is a view of) as the attention layer passes
    them: W_UK's input the query's nope columns, its output the first 512 columns of [T, H, 576]; W_UV a view of
    kv_b_proj's v rows, its input the attention output [T, H, 512], its output [T, H, v]."""
    kv_b, kv_b_s, _ = weight(HEADS * (NOPE + V), LORA)
    heads = kv_b.view(HEADS, NOPE + V, LORA)
    blocks = kv_b_s.view(HEADS, 2, LORA // 128)
    if product == "w_uk":
        w = heads[:, :NOPE].transpose(1, 2).contiguous()
        s = blocks[:, :1].transpose(1, 2).contiguous()
        a = activations(tokens * HEADS, NOPE + ROPE, seed).view(tokens, HEADS, -1)[..., :NOPE].transpose(0, 1)
        whole = torch.full((tokens, HEADS, LORA + ROPE), 7.0, dtype=torch.bfloat16, device="cuda")
        return a, w, s, whole[..., :LORA].transpose(0, 1), whole
    w, s = heads[:, NOPE:], blocks[:, 1:]
    a = activations(tokens * HEADS, LORA, seed).view(tokens, HEADS, LORA).transpose(0, 1)
    whole = torch.empty(tokens, HEADS, V, dtype=torch.bfloat16, device="cuda")
    return a, w, s, whole.transpose(0, 1), whole


@pytest.mark.parametrize("tokens", [1, 2, 16, 64])
@pytest.mark.parametrize("product", ["w_uk", "w_uv"])
def test_batched_kernel_on_the_absorbed_mla_operands(product: str, tokens: int) -> None:
    """Every configuration the tuner may pick, against the per-head reference; W_UK's writes stay inside the
    query's first 512 columns. Tolerance: the dense kernels' output rounding (2⁻⁸·|y|), and for the tensor cores'
    accumulation 2⁻¹⁰·Σ|x_q||W| instead of their 2⁻¹²: W_UK's K is a single 128-deep tile, so no sum over tiles
    averages the truncating FP8 accumulator's error (DeepSeek-V3's report: ~14 bits kept), and over 4M outputs its
    worst case showed — 1.4 × 2⁻¹² with 64-row (wgmma) tiles at 64 tokens (H100, 2026-11-27); 2⁻¹⁰ is 2.9× that."""
    a, w, s, out, whole = absorbed_operands(product, tokens)
    ref = fp8_bmm_ref(a, w, s)
    xq = dequantize_activations_ref(*quantize_activations_ref(a.reshape(-1, a.shape[-1]))).view(a.shape).abs()
    tol = 2.0**-8 * ref.abs() + 2.0**-10 * torch.bmm(xq, dequantize_weight_ref(w, s).abs().transpose(1, 2)) + 1e-30
    failures, report = [], []
    for choice in fp8_gemm.triton_candidates("batched", fp8_gemm.m_bucket(tokens), w.shape[1], w.shape[2], HEADS,
                                             a.device):
        out.fill_(0)
        fp8_gemm._run_batched(choice, a, w, s, out, BLOCK)
        ratio = worst((out.float() - ref).abs(), tol)
        report.append(f"{choice.label()}: {ratio:.3f}")
        if not ratio <= 1:
            failures.append(f"{choice.label()}: err/tol {ratio:.3g}")
        if product == "w_uk" and not bool((whole[..., LORA:] == 7.0).all()):
            failures.append(f"{choice.label()}: wrote past the query's latent columns")
    print(f"\nbatched {product} tokens={tokens}: " + "; ".join(report))
    assert not failures, failures


def test_batched_kernel_graph_replay_and_batch_invariant_tiles() -> None:
    """Graph replay of the tuned batched GEMM equals eager; in batch-invariant mode a token's row does not depend on
    how many tokens share the call."""
    from decode_server.model.batch_invariant import batch_invariant_mode, fp8_batched_matmul

    fp8_gemm.reset_tuner("measure")
    a, w, s, out, _ = absorbed_operands("w_uv", 16)
    eager = fp8_gemm.fp8_batched_linear(a, w, s).clone()  # tuned here, eagerly
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=stream):
        fp8_gemm.fp8_batched_linear(a, w, s, out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    a, w, s, _, _ = absorbed_operands("w_uv", 100, seed=1)
    with batch_invariant_mode():
        together = fp8_batched_matmul(a, w, s, torch.empty(HEADS, 100, V, dtype=torch.bfloat16, device="cuda"))
        alone = [fp8_batched_matmul(a[:, i : i + 1], w, s, torch.empty(HEADS, 1, V, dtype=torch.bfloat16,
                                                                       device="cuda")) for i in (0, 37, 99)]
    assert all(torch.equal(together[:, i : i + 1], one) for i, one in zip((0, 37, 99), alone, strict=True))
