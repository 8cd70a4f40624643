"""Block-FP8 GEMM references (kernels/fp8_gemm_ref.py) on CPU: activation quantization against a brute-force
nearest-e4m3 search, the dequantize-and-matmul reference against the model's own block dequantization, the
rounding bound (it holds, and is within a small factor of the error it bounds), the grouped reference against a
per-expert loop, and the CPU dispatch of kernels/fp8_gemm.py."""

from __future__ import annotations

import pytest
import torch

from decode_server.model.fp8 import dequantize_block_fp8, quantize_block_fp8
from kernels import fp8_gemm
from kernels.fp8_gemm_ref import (
    ACT_EPS,
    FP8_MAX,
    activation_rounding_bound,
    dequantize_activations_ref,
    fp8_grouped_ref,
    fp8_linear_ref,
    quantize_activations_ref,
)

E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_GRID = E4M3_VALUES[torch.isfinite(E4M3_VALUES)].unique()  # sorted, ±448 at the ends


def nearest_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e4m3 value, ties to the one with an even code (brute force over the 253 values)."""
    dist = (v.unsqueeze(-1) - E4M3_GRID).abs()
    best = dist.min(dim=-1, keepdim=True).values
    candidates = torch.where(dist == best, E4M3_GRID, torch.nan)
    codes = candidates.to(torch.float8_e4m3fn).view(torch.uint8).int()
    even = torch.where(torch.isnan(candidates), -1, (codes & 1) == 0)
    pick = torch.where(even == 1, candidates, torch.nan)
    chosen = torch.where(torch.isnan(pick).all(-1, keepdim=True), candidates, pick)
    return chosen.nan_to_num(0.0).sum(-1) / (~torch.isnan(chosen)).sum(-1).clamp(min=1)


def activations(m: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Magnitudes spread over 6 decades so every group has subnormal and normal values after scaling.
    return torch.randn(m, k, generator=gen) * torch.logspace(-4, 2, k)[torch.randperm(k, generator=gen)]


@pytest.mark.parametrize("k", [128, 320, 7])
def test_quantization_is_per_token_group_and_rounds_to_nearest(k: int) -> None:
    x = activations(6, k)
    x[2] = 0.0  # an all-zero row: scale from the amax floor, q = 0
    q, scales = quantize_activations_ref(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (6, k)
    groups = -(-k // 128)
    assert scales.shape == (6, groups)
    padded = torch.nn.functional.pad(x, (0, groups * 128 - k)).view(6, groups, 128)
    torch.testing.assert_close(scales, padded.abs().amax(-1).clamp(min=ACT_EPS) / FP8_MAX, rtol=0, atol=0)
    scaled = (padded / scales.unsqueeze(-1)).view(6, -1)[:, :k]
    assert scaled.abs().max() <= FP8_MAX * (1 + 2**-20)
    assert torch.equal(q.float(), nearest_e4m3(scaled.clamp(-FP8_MAX, FP8_MAX)))
    assert torch.equal(q[2].float(), torch.zeros(k))
    # Every group's largest element maps to ±448 (the full range is used).
    group_max = torch.nn.functional.pad(q.float().abs(), (0, groups * 128 - k)).view(6, groups, 128).amax(-1)
    assert torch.equal(group_max[[0, 1, 3, 4, 5]], torch.full((5, groups), FP8_MAX))


def test_dequantized_activation_error_is_within_the_e4m3_bound() -> None:
    x = activations(4, 512, seed=1)
    q, scales = quantize_activations_ref(x)
    err = (dequantize_activations_ref(q, scales) - x).abs()
    s = scales.repeat_interleave(128, dim=1)
    assert (err <= torch.maximum(2.0**-4 * x.abs(), 2.0**-10 * s) * (1 + 1e-6)).all()
    assert err.max() > 0  # the rounding is real


def weight(n: int, k: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n)[:, None]  # blocks of different magnitude
    return quantize_block_fp8(w)


@pytest.mark.parametrize(("n", "k"), [(256, 384), (200, 320), (576, 256)])
def test_linear_reference_without_input_rounding_is_the_dequantized_matmul(n: int, k: int) -> None:
    w, s = weight(n, k)
    x = activations(5, k)
    # On the CPU the reference is the dequantized float32 matmul itself (the float64 sum is for GPU oracles).
    assert torch.equal(fp8_linear_ref(x, w, s, quantize_input=False), x @ dequantize_block_fp8(w, s).t())


def test_input_rounding_error_is_within_its_bound_and_the_bound_is_tight() -> None:
    w, s = weight(192, 1024)
    x = activations(8, 1024, seed=3)
    exact = fp8_linear_ref(x, w, s, quantize_input=False)
    rounded = fp8_linear_ref(x, w, s)
    bound = activation_rounding_bound(x, w, s)
    err = (rounded - exact).abs()
    assert (err <= bound * (1 + 1e-5) + 1e-6).all()
    # Not vacuous: the worst element uses a visible share of its bound (random signs: roughly 1/sqrt(K) of it).
    assert (err / bound).max() > 1e-3


def test_grouped_reference_is_a_loop_over_experts() -> None:
    experts = [weight(160, 256, seed=10 + e) for e in range(4)]
    w = torch.stack([e[0] for e in experts])
    s = torch.stack([e[1] for e in experts])
    x = activations(11, 256, seed=4)
    ends = torch.tensor([3, 3, 9, 10], dtype=torch.int32)  # expert 1 empty, row 10 past the last expert
    out = fp8_grouped_ref(x, w, s, ends)
    rows = [(0, 3, 0), (3, 9, 2), (9, 10, 3)]
    for start, end, e in rows:
        torch.testing.assert_close(out[start:end], fp8_linear_ref(x[start:end], w[e], s[e]), rtol=1e-6, atol=1e-5)
    assert torch.equal(out[10], torch.zeros(160))


def test_cpu_dispatch_runs_the_references() -> None:
    w, s = weight(128, 256)
    x = activations(3, 256).to(torch.bfloat16)
    out = fp8_gemm.fp8_linear(x.view(1, 3, 256), w, s, bias=torch.ones(128, dtype=torch.bfloat16))
    assert out.shape == (1, 3, 128) and out.dtype == torch.bfloat16
    expected = (fp8_linear_ref(x, w, s).to(torch.bfloat16) + 1).view(1, 3, 128)
    assert torch.equal(out, expected)
    ws = torch.stack([w, w]), torch.stack([s, s])
    grouped = fp8_gemm.fp8_grouped_linear(x, *ws, torch.tensor([1, 3], dtype=torch.int32))
    assert torch.equal(grouped, fp8_grouped_ref(x, *ws, torch.tensor([1, 3])).to(torch.bfloat16))


def test_m_buckets_and_backend_restriction(monkeypatch) -> None:
    assert [fp8_gemm.m_bucket(m) for m in (0, 1, 2, 3, 16, 17, 1 << 20)] == [1, 1, 2, 4, 16, 32, fp8_gemm.MAX_M_BUCKET]
    monkeypatch.setenv(fp8_gemm.BACKEND_ENV, "triton")
    assert fp8_gemm.forced_backend() == "triton"
    with fp8_gemm.force_backend("scaled_mm"):
        assert fp8_gemm.forced_backend() == "scaled_mm"
    assert fp8_gemm.forced_backend() == "triton"
    monkeypatch.setenv(fp8_gemm.BACKEND_ENV, "cublas")
    with pytest.raises(ValueError, match="HISPARSE_FP8_GEMM"):
        fp8_gemm.forced_backend()
    with pytest.raises(ValueError, match="unknown FP8 GEMM backend"), fp8_gemm.force_backend("fast"):
        pass
    # Off Hopper / off CUDA the cuBLAS block-scaled path is never offered.
    assert not fp8_gemm.scaled_mm_supported(1024, 1024, (128, 128), torch.device("cpu"))


def test_triton_candidates_split_k_only_while_the_grid_is_small(monkeypatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setattr(fp8_gemm, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    kv_a = fp8_gemm.triton_candidates("dense", 1, 576, 7168, 0, cuda)  # 9 column tiles: split-K pays
    assert {c.config.block_m for c in kv_a} == {16} and max(c.config.split_k for c in kv_a) >= 8
    q_b = fp8_gemm.triton_candidates("dense", 1, 24576, 1536, 0, cuda)  # 384 tiles of 64: no split at bn 64
    assert all(c.config.split_k == 1 for c in q_b if c.config.block_n == 64)
    prefill = fp8_gemm.triton_candidates("dense", 4096, 7168, 2048, 0, cuda)
    assert {(c.config.block_m, c.config.block_n, c.config.split_k) for c in prefill} == {(64, 128, 1), (128, 128, 1)}
    decode = fp8_gemm.triton_candidates("grouped", 8, 2048, 7168, 32, cuda)  # 8 rows over 32 experts
    assert all(c.config.block_m == 16 and c.config.m_programs == 1 for c in decode)
    big = fp8_gemm.triton_candidates("grouped", 4096, 2048, 7168, 32, cuda)  # 128 rows per expert
    assert {(c.config.block_m, c.config.m_programs) for c in big} == {(64, 2), (128, 1), (64, 4)}
    default = fp8_gemm.default_choice("dense", 1, 576, 7168, 0, cuda)
    assert default in kv_a and default.config.split_k > 1


def test_batched_candidates_quantize_inside_and_offer_the_one_row_kernel_at_decode(monkeypatch) -> None:
    """MLA's absorbed products (kind "batched", 128 heads): no split-K and the quantization always inside (the
    operands are strided views: no quantization kernel can read them as rows); at one or two tokens also the
    one-row kernel, whose loop step never exceeds K's groups (W_UK: K = 128, one group) and is a power of two; the
    untimed default is a tensor-core tile."""
    pytest.importorskip("triton")
    monkeypatch.setattr(fp8_gemm, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    for tokens in (1, 2, 16, 64, 256):
        for n, k in ((512, 128), (128, 512), (256, 384)):
            candidates = fp8_gemm.triton_candidates("batched", tokens, n, k, 128, cuda)
            assert all(c.config.fuse_quant and c.config.split_k == 1 for c in candidates)
            one_row = [c.config for c in candidates if c.config.gemv_groups]
            assert bool(one_row) == (tokens <= fp8_gemm.GEMV_MAX_ROWS_PER_EXPERT)
            for config in one_row:
                assert config.gemv_groups * 128 <= max(128, k) and config.gemv_groups & (config.gemv_groups - 1) == 0
            tiles = {c.config.block_m for c in candidates if not c.config.gemv_groups}
            bm = min(128, max(16, tokens))
            assert tiles == ({bm, bm // 2} if bm > 16 else {16})
            default = fp8_gemm.default_choice("batched", tokens, n, k, 128, cuda)
            assert default in candidates and not default.config.gemv_groups


def test_tuner_keeps_the_fastest_candidate_that_agrees(monkeypatch) -> None:
    """The decision logic on CPU (timing and kernels stubbed): the fastest candidate wins unless its output
    disagrees with the default Triton kernel's, the decision is cached, and a restriction is honoured."""
    pytest.importorskip("triton")
    monkeypatch.setattr(fp8_gemm, "_sm_count", lambda index: 132)
    monkeypatch.setattr(fp8_gemm, "_l2_bytes", lambda index: 1)
    monkeypatch.setattr(fp8_gemm, "scaled_mm_supported", lambda n, k, block, device: True)
    wrong = {"scaled_mm": False}

    def run_dense(choice, rows, w, s, block, dtype):
        out = fp8_linear_ref(rows, w, s, block).to(dtype)
        return out * 1.5 if choice.backend == "scaled_mm" and wrong["scaled_mm"] else out

    def fake_time(fns, calls):
        return [5.0 if fn.args[0].backend == "scaled_mm"
                else 10.0 + fn.args[0].config.split_k + fn.args[0].config.block_n / 64 for fn in fns]

    monkeypatch.setattr(fp8_gemm, "_run_dense", run_dense)
    monkeypatch.setattr(fp8_gemm, "_time_us", fake_time)
    w, s = weight(576, 1024)
    tuner = fp8_gemm.Fp8GemmTuner("measure")
    choice = tuner.choose("dense", 576, 1024, 0, 3, torch.bfloat16, torch.device("cpu"), [(w, s)], (128, 128))
    assert choice.backend == "scaled_mm" and tuner.records[-1].timings_us["scaled_mm"] == 5.0
    assert tuner.choose("dense", 576, 1024, 0, 4, torch.bfloat16, torch.device("cpu"), [(w, s)],
                        (128, 128)) is choice  # same bucket: cached
    assert len(tuner.records) == 1
    wrong["scaled_mm"] = True  # a backend that returns wrong values is never chosen, however fast
    choice = tuner.choose("dense", 576, 1024, 0, 16, torch.bfloat16, torch.device("cpu"), [(w, s)], (128, 128))
    assert choice.backend == "triton" and choice.config.split_k == 1 and choice.config.block_n == 64
    assert any(r.startswith("scaled_mm: RuntimeError: disagrees") for r in tuner.records[-1].rejected)
    wrong["scaled_mm"] = False
    with fp8_gemm.force_backend("triton"):
        choice = tuner.choose("dense", 576, 1024, 0, 64, torch.bfloat16, torch.device("cpu"), [(w, s)], (128, 128))
    assert choice.backend == "triton" and "scaled_mm" not in tuner.records[-1].timings_us


def test_tuner_times_every_agreeing_candidate_in_one_call_and_rejects_one_it_cannot_capture(monkeypatch) -> None:
    """The candidates that agree with the default are timed together, in one `_time_us` call (their graphs replayed
    in turns, so drift hits all alike), after one single-candidate call that sizes the timed batch; a candidate
    whose time comes back NaN (its calls cannot be captured in a CUDA graph) is rejected and never chosen, however
    fast the others make it look."""
    pytest.importorskip("triton")
    monkeypatch.setattr(fp8_gemm, "_sm_count", lambda index: 132)
    monkeypatch.setattr(fp8_gemm, "_l2_bytes", lambda index: 1)
    monkeypatch.setattr(fp8_gemm, "scaled_mm_supported", lambda n, k, block, device: True)
    monkeypatch.setattr(fp8_gemm, "_run_dense", lambda c, rows, w, s, block, dtype: fp8_linear_ref(rows, w, s))
    timed: list[list] = []

    def fake_time(fns, calls):
        timed.append([fn.args[0] for fn in fns])
        # scaled_mm "cannot be captured"; otherwise the most split configuration is the fastest
        return [float("nan") if fn.args[0].backend == "scaled_mm" else 10.0 - fn.args[0].config.split_k
                for fn in fns]

    monkeypatch.setattr(fp8_gemm, "_time_us", fake_time)
    w, s = weight(576, 1024)
    tuner = fp8_gemm.Fp8GemmTuner("measure")
    choice = tuner.choose("dense", 576, 1024, 0, 1, torch.bfloat16, torch.device("cpu"), [(w, s)], (128, 128))
    record = tuner.records[-1]
    cpu = torch.device("cpu")
    candidates = [fp8_gemm.GemmChoice("scaled_mm"), *fp8_gemm.triton_candidates("dense", 1, 576, 1024, 0, cpu)]
    assert timed == [[fp8_gemm.default_choice("dense", 1, 576, 1024, 0, cpu)], candidates]
    assert record.rejected == ["scaled_mm: cannot be captured in a CUDA graph"]
    assert "scaled_mm" not in record.timings_us and len(record.timings_us) == len(candidates) - 1
    assert choice.backend == "triton" and choice.config.split_k == max(c.config.split_k for c in candidates[1:])


def test_grouped_routing_samples_are_the_bucket_ends_spread_over_distinct_experts() -> None:
    """A grouped key is timed at its bucket's fewest and most rows, each row on its own expert while there are
    enough (decode's routing), evenly spread past that."""
    assert fp8_gemm.grouped_routing_samples(1, 9) == [[0]]
    assert fp8_gemm.grouped_routing_samples(2, 9) == [[0, 4]]
    assert fp8_gemm.grouped_routing_samples(4, 9) == [[0, 3, 6], [0, 2, 4, 6]]
    for bucket, experts in ((16, 257), (16, 9), (64, 9), (256, 33)):
        fewest, most = fp8_gemm.grouped_routing_samples(bucket, experts)
        assert (len(fewest), len(most)) == (bucket // 2 + 1, bucket)
        for ids in (fewest, most):
            assert ids == sorted(ids) and max(ids) < experts
            counts = torch.bincount(torch.tensor(ids), minlength=experts)
            assert int(counts.max()) - int(counts.min()) <= 1 or len(ids) < experts
            if len(ids) <= experts:
                assert len(set(ids)) == len(ids)


def test_routing_samples_follow_decode_routing_with_the_shared_expert_in_every_token() -> None:
    """Told the routing (top-k distinct experts a token, and a fused shared expert as the last expert), the samples
    are the fewest and the most tokens whose rows fall in the bucket: each token's routed experts distinct, and
    one row a token on the shared expert (at batch 64 of a top-2 model, 64 of 192 rows)."""
    routing = fp8_gemm.Routing(2, shared_last=True)
    (one_token,) = fp8_gemm.grouped_routing_samples(4, 9, routing)
    assert len(one_token) == 3 and one_token[-1] == 8 and len(set(one_token)) == 3
    (two_tokens,) = fp8_gemm.grouped_routing_samples(8, 9, routing)
    assert len(two_tokens) == 6 and two_tokens.count(8) == 2 and max(two_tokens[:4]) < 8
    fewest, most = fp8_gemm.grouped_routing_samples(256, 9, routing)
    assert (len(fewest), len(most)) == (43 * 3, 85 * 3)
    for ids, tokens in ((fewest, 43), (most, 85)):
        counts = torch.bincount(torch.tensor(ids), minlength=9)
        assert int(counts[8]) == tokens and int(counts[:8].sum()) == 2 * tokens and int(counts[:8].max()) <= tokens
    assert fp8_gemm.grouped_routing_samples(256, 9, routing) == [fewest, most]  # fixed seed: the same samples
    (top8,) = fp8_gemm.grouped_routing_samples(16, 256, fp8_gemm.Routing(8))
    assert len(top8) == 16 and max(top8) < 256
    # No token count lands in the bucket (2 rows, 3 a token): the even rows.
    assert fp8_gemm.grouped_routing_samples(2, 9, routing) == fp8_gemm.grouped_routing_samples(2, 9) == [[0, 4]]


def test_grouped_candidates_also_split_the_smallest_tile_over_twice_the_programs(monkeypatch) -> None:
    """A grouped key past two of its smallest row tiles also offers that tile with twice the programs along M (a
    fused shared expert's rows — one a token — outgrow the average); the default stays the one-program form."""
    pytest.importorskip("triton")
    monkeypatch.setattr(fp8_gemm, "_sm_count", lambda index: 132)
    cpu = torch.device("cpu")
    small = fp8_gemm.triton_candidates("grouped", 32, 4096, 7168, 9, cpu)
    assert all(c.config.m_programs == 1 for c in small if not c.config.gemv_groups)
    wide = fp8_gemm.triton_candidates("grouped", 64, 4096, 7168, 9, cpu)
    doubled = [c.config for c in wide if c.config.m_programs == 2]
    assert doubled and all(c.block_m == 16 and c.block_n == 64 for c in doubled)
    assert fp8_gemm.default_choice("grouped", 64, 4096, 7168, 9, cpu).config.m_programs == 1


def test_grouped_candidates_offer_one_pass_tiles_and_the_last_expert_first(monkeypatch) -> None:
    """Decode's grouped keys past two small tiles (a fused shared expert with a row of every token) also offer the
    64-row tile at 3 stages and 128 registers in both expert orders, the two-programs layout with the last expert
    first, and each layout at 3 stages; the untimed default stays the layout's first form (4 stages, forward
    order, the compiler's registers)."""
    pytest.importorskip("triton")
    monkeypatch.setattr(fp8_gemm, "_sm_count", lambda index: 132)
    cpu = torch.device("cpu")
    labels = [c.label() for c in fp8_gemm.triton_candidates("grouped", 512, 4096, 6144, 33, cpu)]
    for wanted in ("triton bm64 bn64 sk1 w4 s3 r128", "triton bm64 bn64 sk1 w4 s3 r128 rev",
                   "triton bm16 bn64 sk1 w4 s4 mp2 rev", "triton bm32 bn64 sk1 w4 s3", "triton bm32 bn64 sk1 w4 s4"):
        assert wanted in labels
    assert len(labels) == len(set(labels))
    # Few rows an expert (a large expert count): no 64-row tile.
    assert not any("bm64" in c.label() for c in fp8_gemm.triton_candidates("grouped", 64, 6144, 2048, 257, cpu))
    for bucket, experts in ((16, 9), (64, 9), (512, 33), (2048, 33), (4096, 33)):
        default = fp8_gemm.default_choice("grouped", bucket, 4096, 7168, experts, cpu).config
        assert (default.num_stages, default.experts_reversed, default.max_registers) == (
            3 if default.block_m >= 128 else 4, False, 0)
    # Dense keys keep their candidates: the new launch options are the grouped kernel's.
    assert not any(c.config.experts_reversed or c.config.max_registers
                   for c in fp8_gemm.triton_candidates("dense", 64, 4096, 7168, 0, cpu))


def test_tuner_times_a_grouped_key_on_each_routing_sample_and_keeps_the_best_mean(monkeypatch) -> None:
    """Each candidate of a grouped key is timed on every routing sample (the rows and end offsets it is called
    with are the sample's); its recorded time is the mean, so a kernel fast on one routing only is not chosen."""
    pytest.importorskip("triton")
    monkeypatch.setattr(fp8_gemm, "_sm_count", lambda index: 132)
    monkeypatch.setattr(fp8_gemm, "_l2_bytes", lambda index: 1)
    seen: list[tuple[int, tuple[int, ...]]] = []

    def run_grouped(choice, rows, w, s, offsets, block, dtype, shared=None):
        seen.append((rows.shape[0], tuple(offsets.tolist())))
        return fp8_grouped_ref(rows, w, s, offsets, block).to(dtype)

    def fake_time(fns, calls):
        for fn in fns:
            fn(0)  # the call records the sample's rows and offsets
        sample = fns[0].keywords.get("sample", -1)
        # gemv: 10 µs on either sample; tile kernels: 6 µs on the first routing, 20 µs on the second
        return [10.0 if fn.args[0].config.gemv_groups else (6.0 if sample == 0 else 20.0) for fn in fns]

    monkeypatch.setattr(fp8_gemm, "_run_grouped", run_grouped)
    monkeypatch.setattr(fp8_gemm, "_time_us", fake_time)
    experts, n, k = 9, 256, 256
    w, s = quantize_block_fp8(torch.randn(experts * n, k, generator=torch.Generator().manual_seed(3)))
    w, s = w.view(experts, n, k), s.view(experts, n // 128, k // 128)
    tuner = fp8_gemm.Fp8GemmTuner("measure")
    seen.clear()
    choice = tuner.choose("grouped", n, k, experts, 3, torch.float32, torch.device("cpu"), [(w, s)], (128, 128))
    record = tuner.records[-1]
    assert choice.config.gemv_groups and record.timings_us[choice.label()] == 10.0
    tiles = [us for label, us in record.timings_us.items() if " gemv " not in label]
    assert tiles and all(us == 13.0 for us in tiles)  # (6 + 20) / 2
    assert {(3, (1, 1, 1, 2, 2, 2, 3, 3, 3)), (4, (1, 1, 2, 2, 3, 3, 4, 4, 4))} <= set(seen)
    seen.clear()  # told the routing (bucket 8): two tokens of three rows, the last expert in each
    tuner.choose("grouped", n, k, experts, 8, torch.float32, torch.device("cpu"), [(w, s)], (128, 128),
                 fp8_gemm.Routing(2, shared_last=True))
    assert {rows for rows, _ in seen} == {6} and all(offsets[-1] - offsets[-2] == 2 for _, offsets in seen)


def test_tensor_parallel_ranks_adopt_rank0s_decisions_and_freeze(monkeypatch) -> None:
    """Rank 0's decisions move to another rank's device as they are; once frozen, an undecided shape takes the
    default configuration without timing (every rank then runs the same kernels for the replicated layers)."""
    pytest.importorskip("triton")
    monkeypatch.setattr(fp8_gemm, "_sm_count", lambda index: 132)
    monkeypatch.setattr(fp8_gemm, "_l2_bytes", lambda index: 1)
    monkeypatch.setattr(fp8_gemm, "_run_dense", lambda c, rows, w, s, block, dtype: fp8_linear_ref(rows, w, s))
    monkeypatch.setattr(fp8_gemm, "_time_us", lambda fns, calls: [10.0 - fn.args[0].config.split_k for fn in fns])
    w, s = weight(576, 1024)
    rank0 = fp8_gemm.Fp8GemmTuner("measure")
    chosen = rank0.choose("dense", 576, 1024, 0, 1, torch.bfloat16, torch.device("cpu"), [(w, s)], (128, 128))
    assert chosen.config.split_k > 1  # the stub makes the most split configuration the fastest

    def no_timing(fns, calls):
        raise AssertionError("a rank that adopted decisions must not time anything")

    monkeypatch.setattr(fp8_gemm, "_time_us", no_timing)
    rank1 = fp8_gemm.Fp8GemmTuner("measure")
    rank1.install(rank0.export(), torch.device("cuda", 1))
    rank1.frozen = True
    cuda1 = torch.device("cuda", 1)
    assert rank1.choose("dense", 576, 1024, 0, 1, torch.bfloat16, cuda1, [(w, s)], (128, 128)) == chosen
    other = rank1.choose("dense", 576, 1024, 0, 64, torch.bfloat16, torch.device("cpu"), [(w, s)], (128, 128))
    assert other == fp8_gemm.default_choice("dense", 64, 576, 1024, 0, torch.device("cpu"))
    assert rank1.records[-1].timings_us == {}


def test_shared_input_is_quantized_once_and_only_for_kernels_that_read_it(monkeypatch) -> None:
    """The MoE's gate and up GEMMs read one `SharedInput`: no quantization kernel when both chosen kernels quantize
    inside, one when either reads the quantized rows, and each GEMM gets the same quantized tensors."""
    from types import SimpleNamespace

    from kernels.fp8_gemm_triton import TritonGemmConfig

    made, seen = [], []

    def quantize(x):
        made.append(x)
        return torch.zeros_like(x), torch.ones(1)

    def gemm(a, scales, w, w_scale, ends, out_dtype, config, block):
        seen.append((a, scales))
        return torch.zeros(a.shape[0], w.shape[1])

    monkeypatch.setattr(fp8_gemm, "_triton", lambda: SimpleNamespace(
        quantize_activations=quantize, fp8_grouped_gemm=gemm, fp8_grouped_gemv=gemm))
    x, w, s, ends = torch.randn(3, 256), torch.zeros(2, 128, 256), torch.ones(2, 1, 2), torch.tensor([1, 3])
    inside = fp8_gemm.GemmChoice("triton", TritonGemmConfig(block_n=16, gemv_groups=2, fuse_quant=True))
    reads = fp8_gemm.GemmChoice("triton", TritonGemmConfig(16, 64, 1))
    for first, second, kernels in ((inside, inside, 0), (inside, reads, 1), (reads, reads, 1)):
        made.clear()
        seen.clear()
        shared = fp8_gemm.SharedInput(x)
        for choice in (first, second):
            fp8_gemm._run_grouped(choice, x, w, s, ends, (128, 128), torch.float32, shared)
        assert len(made) == kernels
        quantized = [a for a, scales in seen if scales is not None]
        assert all(a is quantized[0] for a in quantized)
        assert all(a is x for a, scales in seen if scales is None)
