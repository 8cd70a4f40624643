"""Runs the block-FP8 Triton kernels (kernels/fp8_gemm_triton.py) in Triton's CPU interpreter against the
references; started by test_fp8_triton_interpret.py in a fresh process with TRITON_INTERPRET=1 (Triton reads it
when the kernels are defined, so it must be set before they are imported). Exits non-zero on the first
mismatch; prints one line per case."""

from __future__ import annotations

import dataclasses
import os
import sys
from unittest import mock

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1")

import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

from decode_server.model.fp8 import quantize_block_fp8  # noqa: E402
from kernels import fp8_gemm_triton as tri  # noqa: E402
from kernels.fp8_bmm_triton import fp8_bmm  # noqa: E402
from kernels.fp8_gemm_ref import (  # noqa: E402
    dequantize_activations_ref,
    dequantize_weight_ref,
    fp8_bmm_ref,
    fp8_grouped_ref,
    fp8_linear_ref,
    quantize_activations_ref,
)

# Triton 3.6's interpreter holds scalars as 1-element arrays and converts them with int(array), which NumPy ≥ 2.4
# refuses for arrays that are not 0-d; loops over kernel arguments (`range(0, n)`) need that conversion.
_patch = getattr(interpreter, "_patch_lang_tensor", None)
if _patch is not None:
    def _patched(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patched


def activations(m: int, k: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, k)[torch.randperm(k, generator=gen)]).to(dtype)


def weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return quantize_block_fp8(torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n)[:, None])


def tolerance(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, ref: torch.Tensor, out_dtype) -> torch.Tensor:
    """Output rounding + float32 summation in another order. bf16 output: less than one ulp (2^-7 relative; the
    interpreter converts float32 → bf16 by truncation where the GPU rounds to nearest); float32: none."""
    xq = dequantize_activations_ref(*quantize_activations_ref(x)).abs()
    rel = 2.0**-7 if out_dtype == torch.bfloat16 else 0.0
    return rel * ref.abs() + 2.0**-16 * (xq @ dequantize_weight_ref(w, s).abs().t()) + 1e-30


def check(name: str, got: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> None:
    err = (got.float() - ref).abs()
    if not (err <= tol).all():
        worst = int((err - tol).argmax())
        sys.exit(f"FAIL {name}: error {err.flatten()[worst]:.3g} > tolerance {tol.flatten()[worst]:.3g}")
    print(f"ok {name}: max error {err.max():.3g}, max |ref| {ref.abs().max():.3g}")


def test_quantize() -> None:
    for m, k, pad, dtype in [(5, 320, 4, torch.float32), (3, 100, 1, torch.bfloat16), (1, 1152, 4, torch.bfloat16)]:
        x = activations(m, k, seed=m + k, dtype=dtype)
        if m > 2:
            x[1] = 0
        q, scales = tri.quantize_activations(x, pad_rows_to=pad)
        q_ref, s_ref = quantize_activations_ref(x)
        m_pad = -(-m // pad) * pad
        assert q.shape == (m_pad, k) and scales.shape == (s_ref.shape[1], m_pad), (q.shape, scales.shape)
        # Values compared as numbers: the interpreter writes a negative value that rounds to zero as +0.
        if not torch.equal(q[:m].float(), q_ref.float()):
            bad = (q[:m].float() != q_ref.float()).nonzero()[:3].tolist()
            sys.exit(f"FAIL quantize {m}x{k}: values differ at {bad}")
        if not torch.equal(scales[:, :m].t(), s_ref):
            sys.exit(f"FAIL quantize {m}x{k}: scales differ")
        if m_pad > m and q[m:].float().abs().max() != 0:
            sys.exit(f"FAIL quantize {m}x{k}: padded rows are not zero")
        print(f"ok quantize {m}x{k} {dtype} pad {pad}: equal to the reference")


def test_dense() -> None:
    cases = [  # (M, N, K, config, output dtype)
        (5, 200, 640, tri.TritonGemmConfig(16, 64, 1), torch.float32),
        (5, 200, 640, tri.TritonGemmConfig(32, 128, 2), torch.bfloat16),
        (1, 576, 256, tri.TritonGemmConfig(16, 64, 1), torch.bfloat16),  # kv_a's ragged 576 rows (4.5 blocks)
        (17, 64, 100, tri.TritonGemmConfig(16, 64, 1), torch.float32),  # ragged K: one partial group
        (3, 128, 640, tri.TritonGemmConfig(16, 64, 3), torch.float32),  # 5 K tiles in 3 splits of 2 (last: 1)
    ]
    for i, (m, n, k, config, out_dtype) in enumerate(cases):
        x = activations(m, k, seed=10 + i)
        w, s = weights(n, k, seed=20 + i)
        q, scales = tri.quantize_activations(x)
        got = tri.fp8_gemm(q, scales, m, w, s, out_dtype, config)
        assert got.shape == (m, n) and got.dtype == out_dtype
        ref = fp8_linear_ref(x, w, s)
        check(f"dense {m}x{n}x{k} {config.label()} {out_dtype}", got, ref, tolerance(x, w, s, ref, out_dtype))


def same_bits(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.equal(got.float(), want.float()):
        sys.exit(f"FAIL {name}: differs from the unfused kernel by {(got.float() - want.float()).abs().max():.3g}")
    print(f"ok {name}: the same bits as the unfused kernel")


def test_dense_fused() -> None:
    """Quantization and the split-K sum inside the GEMM give the unfused kernel's bits (same tiles), also when
    the counters are reused by the next call."""
    cases = [  # (M, N, K, config, output dtype)
        (1, 576, 640, tri.TritonGemmConfig(16, 64, 4), torch.bfloat16),  # 5 K tiles in 3 splits (2, 2, 1)
        (5, 200, 640, tri.TritonGemmConfig(16, 64, 2), torch.float32),
        (17, 64, 100, tri.TritonGemmConfig(16, 64, 1), torch.float32),  # ragged K, two row tiles, no split
        (3, 128, 1152, tri.TritonGemmConfig(16, 128, 8), torch.bfloat16),
    ]
    for i, (m, n, k, base, out_dtype) in enumerate(cases):
        x = activations(m, k, seed=40 + i, dtype=torch.bfloat16)
        w, s = weights(n, k, seed=50 + i)
        q, scales = tri.quantize_activations(x)
        want = tri.fp8_gemm(q, scales, m, w, s, out_dtype, base)
        for fq, fr in ((True, False), (False, True), (True, True)):
            config = tri.TritonGemmConfig(base.block_m, base.block_n, base.split_k, fuse_quant=fq, fuse_reduce=fr)
            for call in range(2):  # the second call finds the counters the first one reset
                got = tri.fp8_gemm(x if fq else q, None if fq else scales, m, w, s, out_dtype, config)
                assert got.shape == (m, n) and got.dtype == out_dtype
                same_bits(f"dense {m}x{n}x{k} {config.label()} call {call}", got, want)
    counters = [t for t in tri._counters.values()]
    if any(int(t.abs().sum()) for t in counters):
        sys.exit("FAIL fused reduce: tile counters not back at 0")
    print("ok fused reduce: every tile counter back at 0")


def test_dense_reads_the_attached_quantized_form() -> None:
    """`_run_dense` with a non-fused kernel reads the FP8 form its input's producer attached (kernels/fp8_gemm.py
    `attach_quantized`) instead of quantizing: with x's true form the bits of the quantizing run; with a form that
    is not x's (to prove the path), that form's product. A fused kernel quantizes x itself either way."""
    from kernels import fp8_gemm

    x = activations(1, 640, seed=91, dtype=torch.float32)
    w, s = weights(192, 640, seed=92)
    plain = fp8_gemm.GemmChoice("triton", tri.TritonGemmConfig(block_n=16, gemv_groups=4))
    want = fp8_gemm._run_dense(plain, x, w, s, (128, 128), torch.float32)
    true_form = tri.quantize_activations(x)
    same_bits("dense with the attached FP8 form", fp8_gemm._run_dense(plain, x, w, s, (128, 128), torch.float32,
                                                                       true_form), want)
    other = tri.quantize_activations(x * 2)
    got = fp8_gemm._run_dense(plain, x, w, s, (128, 128), torch.float32, other)
    same_bits("dense with another attached form", got, tri.fp8_gemv(*other, 1, w, s, torch.float32, plain.config))
    if torch.equal(got, want):
        sys.exit("FAIL dense: a foreign attached form gave x's product (the attached form was not read)")
    fused = fp8_gemm.GemmChoice("triton", tri.TritonGemmConfig(block_n=16, gemv_groups=4, fuse_quant=True))
    same_bits("fused dense ignores the attached form",
              fp8_gemm._run_dense(fused, x, w, s, (128, 128), torch.float32, other), want)


def test_gemv() -> None:
    """The one-row kernel: within the summation tolerance of the reference (ragged N — a program's rows past N —
    ragged K, K not a multiple of a loop step, bf16 and float32 outputs), and the quantization inside it gives the
    bits of the kernel reading the quantization kernel's output."""
    cases = [  # (N, K, BLOCK_N, groups, output dtype)
        (200, 640, 8, 4, torch.float32),  # 5 groups: one full step of 4 and a step with one group
        (576, 256, 32, 2, torch.bfloat16),  # kv_a's ragged 576 rows
        (64, 100, 16, 4, torch.float32),  # ragged K: one partial group
        (128, 1152, 16, 8, torch.bfloat16),
    ]
    for i, (n, k, block_n, groups, out_dtype) in enumerate(cases):
        x = activations(1, k, seed=70 + i, dtype=torch.bfloat16)
        w, s = weights(n, k, seed=80 + i)
        q, scales = tri.quantize_activations(x)
        config = tri.TritonGemmConfig(block_n=block_n, gemv_groups=groups, gemv_stages=1 + 2 * (i % 2))
        got = tri.fp8_gemv(q, scales, 1, w, s, out_dtype, config)
        assert got.shape == (1, n) and got.dtype == out_dtype
        ref = fp8_linear_ref(x, w, s)
        check(f"gemv 1x{n}x{k} {config.label()} {out_dtype}", got, ref, tolerance(x, w, s, ref, out_dtype))
        fused = tri.TritonGemmConfig(block_n=block_n, gemv_groups=groups, gemv_stages=config.gemv_stages,
                                     fuse_quant=True)
        same_bits(f"gemv 1x{n}x{k} {fused.label()}", tri.fp8_gemv(x, None, 1, w, s, out_dtype, fused), got)
    empty = tri.fp8_gemv(activations(1, 256, seed=1)[:0], None, 0, *weights(64, 256, seed=2), torch.float32,
                         tri.TritonGemmConfig(block_n=8, gemv_groups=2, fuse_quant=True))
    assert empty.shape == (0, 64)


def test_grouped() -> None:
    experts, n, k = 4, 192, 384
    pairs = [weights(n, k, seed=30 + e) for e in range(experts)]
    w = torch.stack([p[0] for p in pairs])
    s = torch.stack([p[1] for p in pairs])
    x = activations(40, k, seed=5)
    # Expert 1 empty, expert 2 with 33 rows (three 16-row tiles), rows 39.. past the last expert (left undefined).
    ends = torch.tensor([4, 4, 37, 39], dtype=torch.int32)
    ref = fp8_grouped_ref(x, w, s, ends)
    xq = dequantize_activations_ref(*quantize_activations_ref(x)).abs()
    wabs = dequantize_weight_ref(w, s).abs()
    tol = 2.0**-16 * torch.cat([xq[a:b] @ wabs[e].t() for e, (a, b) in enumerate([(0, 4), (4, 4), (4, 37), (37, 39)])])
    for config in (tri.TritonGemmConfig(16, 64, 1), tri.TritonGemmConfig(16, 128, 2, m_programs=2),
                   tri.TritonGemmConfig(32, 64, 1, m_programs=4)):
        q, scales = tri.quantize_activations(x)
        got = tri.fp8_grouped_gemm(q, scales, w, s, ends, torch.float32, config)
        check(f"grouped E={experts} {config.label()}", got[:39], ref[:39], tol + 1e-30)
        fused = tri.TritonGemmConfig(config.block_m, config.block_n, config.split_k, m_programs=config.m_programs,
                                     fuse_quant=True, fuse_reduce=True)
        for call in range(2):
            again = tri.fp8_grouped_gemm(x, None, w, s, ends, torch.float32, fused)
            same_bits(f"grouped E={experts} {fused.label()} call {call}", again[:39], got[:39])
        # The launch options that only reorder programs or cap registers (the last expert's programs first, Triton's
        # maxnreg — ignored by the interpreter) and the pipeline depth: the same bits as the launch they vary.
        for variant in (dataclasses.replace(config, experts_reversed=True),
                        dataclasses.replace(config, experts_reversed=True, num_stages=3, max_registers=128),
                        dataclasses.replace(fused, experts_reversed=True)):
            again = tri.fp8_grouped_gemm(x if variant.fuse_quant else q, None if variant.fuse_quant else scales, w, s,
                                         ends, torch.float32, variant)
            same_bits(f"grouped E={experts} {variant.label()}", again[:39], got[:39])
    # A 64-row tile runs expert 2's 33 rows in one pass over its weights.
    q, scales = tri.quantize_activations(x)
    wide = tri.fp8_grouped_gemm(q, scales, w, s, ends, torch.float32,
                                tri.TritonGemmConfig(64, 64, 1, num_stages=3, max_registers=128, experts_reversed=True))
    check(f"grouped E={experts} 64-row tile", wide[:39], ref[:39], tol + 1e-30)
    if any(int(t.abs().sum()) for t in tri._counters.values()):
        sys.exit("FAIL grouped fused reduce: tile counters not back at 0")
    # The grouped one-row kernel on decode-like rows: expert 0 one row, expert 1 none, expert 2 three rows (its
    # weights read once per row), expert 3 one row, row 5.. past the last expert (left undefined).
    ends = torch.tensor([1, 1, 4, 5], dtype=torch.int32)
    x = activations(7, k, seed=6, dtype=torch.bfloat16)
    ref = fp8_grouped_ref(x, w, s, ends)
    xq = dequantize_activations_ref(*quantize_activations_ref(x)).abs()
    tol = 2.0**-16 * torch.cat([xq[a:b] @ wabs[e].t() for e, (a, b) in enumerate([(0, 1), (1, 1), (1, 4), (4, 5)])])
    q, scales = tri.quantize_activations(x)
    for block_n, groups in ((16, 2), (32, 4)):
        config = tri.TritonGemmConfig(block_n=block_n, gemv_groups=groups)
        got = tri.fp8_grouped_gemv(q, scales, w, s, ends, torch.float32, config)
        check(f"grouped one-row E={experts} {config.label()}", got[:5], ref[:5], tol + 1e-30)
        fused = tri.TritonGemmConfig(block_n=block_n, gemv_groups=groups, fuse_quant=True)
        again = tri.fp8_grouped_gemv(x, None, w, s, ends, torch.float32, fused)
        same_bits(f"grouped one-row E={experts} {fused.label()}", again[:5], got[:5])
        # The row-program form: the same arithmetic per row, so the same bits; rows 5.. (past the last expert)
        # are skipped, not written.
        for stages, fuse in ((1, False), (3, True)):
            rows_form = tri.TritonGemmConfig(block_n=block_n, gemv_groups=groups, fuse_quant=fuse, gemv_stages=stages,
                                             gemv_row_programs=True)
            sentinel = torch.full((7, n), 5.0)
            with mock.patch.object(torch, "empty", return_value=sentinel):
                by_row = tri.fp8_grouped_gemv(x if fuse else q, None if fuse else scales, w, s, ends, torch.float32,
                                              rows_form)
            same_bits(f"grouped one-row E={experts} {rows_form.label()}", by_row[:5], got[:5])
            if not bool((by_row[5:] == 5.0).all()):
                sys.exit(f"FAIL grouped one-row {rows_form.label()}: wrote rows past the last expert")


def test_batched() -> None:
    """The batched kernels (kernels/fp8_bmm_triton.py) on MLA's strided operands: the query's nope columns inside
    [T, H, nope + rope] times a transposed W_UK into the first columns of [T, H, 576]-like rows (the rest of each
    row untouched), and the attention output times W_UV taken as a view of kv_b_proj's rows into [T, H, v]; both
    kernels, one and several row tiles, a ragged K tile, no rows."""
    heads, nope, rope, lora, v = 4, 128, 64, 384, 128
    kv_b, kv_b_scale = weights(heads * (nope + v), lora, seed=90)
    w_uv = kv_b.view(heads, nope + v, lora)[:, nope:]
    s_uv = kv_b_scale.view(heads, 2, 3)[:, 1:]
    w_uk = kv_b.view(heads, nope + v, lora)[:, :nope].transpose(1, 2).contiguous()
    s_uk = kv_b_scale.view(heads, 2, 3)[:, :1].transpose(1, 2).contiguous()
    tensor_core = [tri.TritonGemmConfig(16, 64), tri.TritonGemmConfig(16, 128), tri.TritonGemmConfig(32, 64)]
    one_row = [tri.TritonGemmConfig(block_n=16, gemv_groups=1), tri.TritonGemmConfig(block_n=32, gemv_groups=2)]
    for tokens, configs in ((1, one_row + tensor_core[:1]), (2, one_row[:1]), (3, tensor_core), (33, tensor_core[2:])):
        q = activations(tokens * heads, nope + rope, seed=tokens, dtype=torch.bfloat16).view(tokens, heads, -1)
        latent = activations(tokens * heads, lora, seed=100 + tokens, dtype=torch.bfloat16).view(tokens, heads, lora)
        for config in configs:
            query = torch.full((tokens, heads, lora + rope), 7.0, dtype=torch.bfloat16)
            a = q[..., :nope].transpose(0, 1)
            fp8_bmm(a, w_uk, s_uk, query[..., :lora].transpose(0, 1), config)
            ref = fp8_bmm_ref(a, w_uk, s_uk)
            for g in range(heads):
                check(f"batched W_UK T={tokens} head {g} {config.label()}", query[:, g, :lora], ref[g],
                      tolerance(a[g], w_uk[g], s_uk[g], ref[g], torch.bfloat16))
            if not bool((query[..., lora:] == 7.0).all()):
                sys.exit(f"FAIL batched W_UK {config.label()}: wrote past its columns")
            out = torch.empty(tokens, heads, v, dtype=torch.float32)
            a = latent.transpose(0, 1)
            fp8_bmm(a, w_uv, s_uv, out.transpose(0, 1), config)
            ref = fp8_bmm_ref(a, w_uv, s_uv)
            for g in range(heads):
                check(f"batched W_UV T={tokens} head {g} {config.label()}", out[:, g], ref[g],
                      tolerance(a[g], w_uv[g], s_uv[g], ref[g], torch.float32))
            print(f"ok batched T={tokens} {config.label()}: W_UK into the query's columns, W_UV from kv_b's view")
    untouched = torch.full((heads, 0, v), 3.0)
    fp8_bmm(latent[:0].transpose(0, 1), w_uv, s_uv, untouched, one_row[0])
    assert untouched.shape == (heads, 0, v)


if __name__ == "__main__":
    test_quantize()
    test_dense()
    test_dense_fused()
    test_dense_reads_the_attached_quantized_form()
    test_gemv()
    test_grouped()
    test_batched()
    print("all interpreter cases passed")
