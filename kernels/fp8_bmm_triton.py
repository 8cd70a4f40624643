"""Batched block-FP8 GEMM in Triton: out[g] = a[g] @ dequant(w[g])ᵀ for G independent groups (semantics:
kernels/fp8_gemm_ref.py `fp8_bmm_ref`).

Its user is MLA's absorbed attention, where each head multiplies its own rows by its own matrix: the query
absorption q_nope · W_UK (G heads, K = qk_nope_head_dim, N = kv_lora_rank) and the value up-projection
o_latent · W_UV (K = kv_lora_rank, N = v_head_dim), with the weights kept in the checkpoint's block FP8 instead of
dequantized to bf16 (decode_server/model/attention.py `absorb_weights`). Everything is addressed through strides,
so the operands are the model's tensors as they lie — the query's nope columns inside [T, H, nope + rope], the
attention output [T, H, 512], W_UV as a view of kv_b_proj's FP8 rows, the outputs written straight into the
absorbed query [T, H, 576] and o_proj's input [T, H·v] — and no transposing copy runs around the GEMM.

The activations are quantized inside the kernel (per row and 128-channel group, `_quantize_values`: the same
arithmetic as kernels/fp8_gemm_triton.quantize_activations), so each call is one launch. Two kernels, both taking
`TritonGemmConfig`:
  - tensor cores (`gemv_groups` 0): program (column tile, group, row tile), `_tile_product` over all of K (K here is
    at most a few 128-tiles, and the G groups already give every SM work: no split-K);
  - one row at a time (`gemv_groups` > 0, decode's one or two tokens): program (column block, group), each of the
    group's rows against BLOCK_N weight rows without tensor cores (`_row_dot`).
A row's result depends on its own values, its group's weights and the configuration only (no split-K, no atomics),
so it is deterministic, and graph replay equals eager. Launch shapes never depend on device values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_gemm_triton import GROUP, TritonGemmConfig, _row_dot, _tile_product


@triton.jit(do_not_specialize=["m"])
def _fp8_bmm_kernel(a_ptr, b_ptr, bs_ptr, c_ptr, m, n, k, k_tiles,
                    stride_ag, stride_am, stride_bg, stride_bn, stride_bsg, stride_bsn, stride_bsk,
                    stride_cg, stride_cm,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BN: tl.constexpr):
    pid_n = tl.program_id(0)
    group = tl.program_id(1).to(tl.int64)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_m < m
    n_ok = offs_n < n
    a_group = a_ptr + group * stride_ag
    acc = _tile_product(a_group, a_group, b_ptr + group * stride_bg, bs_ptr + group * stride_bsg, offs_m, row_ok,
                        offs_n, n_ok, 0, k_tiles, k, stride_am, 0, stride_bn, stride_bsn, stride_bsk,
                        BLOCK_M, BLOCK_N, BLOCK_K, SCALE_BN, True)
    out = c_ptr + group * stride_cg + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["m"])
def _fp8_bmm_gemv_kernel(a_ptr, b_ptr, bs_ptr, c_ptr, m, n, k,
                         stride_ag, stride_am, stride_bg, stride_bn, stride_bsg, stride_bsn, stride_bsk,
                         stride_cg, stride_cm,
                         BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, SCALE_BN: tl.constexpr, STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    group = tl.program_id(1).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    w_rows = b_ptr + group * stride_bg + cols.to(tl.int64) * stride_bn
    w_scales = bs_ptr + group * stride_bsg + ((pid_n * BLOCK_N) // SCALE_BN) * stride_bsn
    a_group = a_ptr + group * stride_ag
    c_group = c_ptr + group * stride_cg
    for row in range(0, m):
        out = _row_dot(a_group + row * stride_am, a_group, 0, w_rows, w_scales, col_ok, k, stride_bsk, BLOCK_N,
                       GROUPS, True, STAGES)
        tl.store(c_group + row * stride_cm + cols, out.to(c_ptr.dtype.element_ty), mask=col_ok)


def _check(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor, block: tuple[int, int],
           config: TritonGemmConfig) -> None:
    if a.dim() != 3 or w.dim() != 3 or w_scale.dim() != 3 or out.dim() != 3:
        raise ValueError(f"batched operands are 3-D: a [G, M, K], w [G, N, K], scales [G, N/bn, K/128], out "
                         f"[G, M, N]; got {tuple(a.shape)}, {tuple(w.shape)}, {tuple(w_scale.shape)}, "
                         f"{tuple(out.shape)}")
    groups, m, k = a.shape
    n = w.shape[1]
    if w.shape[0] != groups or w.shape[2] != k or tuple(out.shape) != (groups, m, n):
        raise ValueError(f"batched shapes disagree: a {tuple(a.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)}")
    if a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"the batched kernel quantizes its input itself: a must be bf16/fp16/fp32, got {a.dtype}")
    if w.dtype != torch.float8_e4m3fn or w_scale.dtype != torch.float32:
        raise ValueError(f"weights must be float8_e4m3fn with float32 block scales, got {w.dtype}, {w_scale.dtype}")
    if a.stride(2) != 1 or w.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("a, w and out must have contiguous last dimensions")
    if block[1] != GROUP:
        raise ValueError(f"the kernels take 128-channel K blocks (one activation group each), got {block}")
    expected = (groups, triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
    if tuple(w_scale.shape) != expected:
        raise ValueError(f"weight scales must be {expected}, got {tuple(w_scale.shape)}")
    if config.gemv_groups and block[0] % config.block_n:
        raise ValueError(f"BLOCK_N {config.block_n} must divide the weight block's {block[0]} rows")


def fp8_bmm(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor, config: TritonGemmConfig,
            block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """out[g] = a[g] [M, K] (unquantized, any strides but a contiguous last dim) @ dequant(w[g] [N, K] e4m3,
    w_scale[g] [N/bn, K/128] float32)ᵀ, written into `out` [G, M, N] (any strides, contiguous last dim; its dtype is
    the output's). The configuration's fuse flags and split-K are ignored: the input is always quantized inside and
    K is never split."""
    _check(a, w, w_scale, out, block, config)
    groups, m, k = a.shape
    n = w.shape[1]
    if not (groups and m and n):
        return out
    strides = (a.stride(0), a.stride(1), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1),
               w_scale.stride(2), out.stride(0), out.stride(1))
    if config.gemv_groups:
        _fp8_bmm_gemv_kernel[(triton.cdiv(n, config.block_n), groups)](
            a, w, w_scale, out, m, n, k, *strides, BLOCK_N=config.block_n, GROUPS=config.gemv_groups,
            SCALE_BN=block[0], STAGES=config.gemv_stages, num_warps=config.num_warps)
    else:
        grid = (triton.cdiv(n, config.block_n), groups, triton.cdiv(m, config.block_m))
        _fp8_bmm_kernel[grid](
            a, w, w_scale, out, m, n, k, triton.cdiv(k, GROUP), *strides, BLOCK_M=config.block_m,
            BLOCK_N=config.block_n, BLOCK_K=GROUP, SCALE_BN=block[0], num_warps=config.num_warps,
            num_stages=config.num_stages)
    return out
