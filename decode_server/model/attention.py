"""Multi-head latent attention (MLA) of DeepSeek-V3.2 / GLM-5 in absorbed form, with DSA top-k selection.

Per new token (T of them, prefill chunk or decode alike):
  c_q  = RMSNorm(q_a_proj(x));  q = q_b_proj(c_q) → [H, nope + rope] = [q_nope ; q_pe], q_pe roped (interleaved)
  kv_a = kv_a_proj_with_mqa(x) → [c_kv (512) ; k_pe (64)];  row = [RMSNorm(c_kv) ; RoPE(k_pe)]  (576 values)
  absorbed query per head  [W_UKᵀ q_nope ; q_pe]  (576), so scores are q·row and values are row[:512];
  output per head  W_UV · o_latent, concatenated, then o_proj.
KV memory is reached only through the forward context's attention backend, in the contract's order:
write_index_keys → index_topk → prepare_attention → write_kv → sparse_attention (engine/attention_backend.py). Nothing here is sized by the prefix length.
GLM-5's "shared" layers have no indexer: they skip write_index_keys / index_topk and attend over the top-k
positions of the previous full layer of the same forward pass (cross-layer top-k sharing).

The latent norms (q_a_layernorm, kv_a_layernorm) use eps 1e-6 whatever `rms_norm_eps` says, as transformers'
DeepseekV32 and GlmMoeDsa (and DeepSeek's inference code) do; `rms_norm_eps` is for the decoder norms (GLM-5:
1e-5). vLLM and SGLang pass `rms_norm_eps` to the latent norms too; that differs only for GLM-5.
"""

from __future__ import annotations

import torch
from torch import nn

from decode_server.engine.forward_context import get_forward_context
from decode_server.model import fused_ops
from decode_server.model.batch_invariant import Linear, batched_matmul, fp8_batched_matmul
from decode_server.model.config import ModelConfig
from decode_server.model.fp8 import dequantize_block_fp8
from decode_server.model.fused_linear import FusedLinear, worth_stacking
from decode_server.model.indexer import Indexer
from decode_server.model.layers import RMSNorm
from decode_server.parallel.layers import column_linear, row_linear, split_size
from decode_server.parallel.state import ParallelState, resolve

# Tokens per step of the query absorption (bounds its temporary to this many tokens × H × 512).
_ABSORB_CHUNK_TOKENS = 1024
LATENT_NORM_EPS = 1e-6


class MLAAttention(nn.Module):
    """With tensor parallelism each rank holds `num_attention_heads / tp_size` heads (q_b_proj and kv_b_proj
    column-parallel by heads, o_proj row-parallel + all-reduce); the latent KV projection, the norms and the
    indexer are replicated, so every rank writes the same latent rows and selects the same top-k."""

    def __init__(self, config: ModelConfig, layer_id: int, parallel: ParallelState | None = None) -> None:
        super().__init__()
        parallel = resolve(parallel)
        self.layer_id = layer_id
        self.num_heads = split_size(config.num_attention_heads, parallel.tp_size, "num_attention_heads")
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.softmax_scale = config.softmax_scale
        self.index_topk = config.index_topk
        bias = config.attention_bias
        self.q_a_proj = Linear(config.hidden_size, config.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
        heads = config.num_attention_heads  # all ranks' heads; the parallel linears keep this rank's share
        self.q_b_proj = column_linear(config.q_lora_rank, heads * config.qk_head_dim, False, parallel)
        self.kv_a_proj_with_mqa = Linear(config.hidden_size, config.kv_row_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = column_linear(config.kv_lora_rank, heads * (self.nope_dim + self.v_dim), False, parallel)
        self.o_proj = row_linear(heads * self.v_dim, config.hidden_size, bias, parallel)
        self.indexer = Indexer(config) if config.is_index_layer(layer_id) else None
        # Absorbed up-projections, filled from kv_b_proj by `absorb_weights`: model dtype W_UK [H, nope, 512] and
        # W_UV [H, v, 512], or (absorbed_fp8) block FP8 W_UKᵀ [H, 512, nope] and W_UV [H, v, 512] (a view of
        # kv_b_proj's rows) with their block scales.
        self.register_buffer("w_uk", torch.empty(0), persistent=False)
        self.register_buffer("w_uv", torch.empty(0), persistent=False)
        self.register_buffer("w_uk_scale", torch.empty(0), persistent=False)
        self.register_buffer("w_uv_scale", torch.empty(0), persistent=False)
        self.absorbed_fp8 = False
        self.weights_absorbed = False  # set by `absorb_weights` (the buffers may hold reserved, unfilled storage)
        # q_a, the indexer's wk and kv_a as one GEMM (`fuse_input_projections`); None: three GEMMs.
        self.fused_inputs: FusedLinear | None = None
        # q_b and the indexer's wq_b (both read the normalized query latent) as one GEMM (`fuse_query_projections`).
        self.fused_queries: FusedLinear | None = None

    def input_projections(self) -> list[Linear]:
        """The projections of the layer's input x, in the order they are stacked when fused: q_a, the indexer's
        wk (layers that run the indexer), kv_a last (its 576 rows end in a partial FP8 block)."""
        projections = [self.q_a_proj]
        if self.indexer is not None:
            projections.append(self.indexer.wk)
        projections.append(self.kv_a_proj_with_mqa)
        return projections

    @torch.no_grad()
    def fuse_input_projections(self, copy: bool = True) -> None:
        """Give q_a, wk and kv_a one stacked weight (decode_server/model/fused_linear.py) so that they run as one
        GEMM. copy False: at construction, before loading (the loader fills the stack through the projections);
        True: restack the current values, unless they already are stacked. Projections that cannot share a
        stack (mixed dtypes, FP8 blocks that do not line up) stay separate."""
        projections = self.input_projections()
        if self.fused_inputs is not None and self.fused_inputs.current():
            return
        self.fused_inputs = FusedLinear(projections, copy) if worth_stacking(projections) else None

    def project_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(q_a(x), wk(x) or None without an indexer, kv_a(x)): one GEMM when fused, else three."""
        fused = self.fused_inputs
        if fused is not None and not fused.current():  # a parameter was replaced since (device move, reload)
            self.fuse_input_projections(copy=True)
            fused = self.fused_inputs
        outs = fused(x) if fused is not None else [proj(x) for proj in self.input_projections()]
        return outs[0], (outs[1] if self.indexer is not None else None), outs[-1]

    def query_projections(self) -> list[Linear]:
        """The projections of the normalized query latent, in stack order: q_b, then the indexer's wq_b (layers
        that run the indexer)."""
        return [self.q_b_proj] + ([self.indexer.wq_b] if self.indexer is not None else [])

    @torch.no_grad()
    def fuse_query_projections(self, copy: bool = True) -> None:
        """Give q_b and the indexer's wq_b one stacked weight (as `fuse_input_projections` does for the input's
        projections): one GEMM reads the query latent once instead of two launches — the indexer's 12.6 MB FP8 wq_b
        alone runs at ~45 % of the H200's copy rate at batch 1 (docs/benchmarks.md). q_b's output is then ready
        before the indexer runs, which is only earlier. Layers without an indexer (GLM-5's shared layers) keep q_b
        alone; so do projections that cannot share a stack or whose stacked FP8 shape this GPU has not measured."""
        projections = self.query_projections()
        if self.fused_queries is not None and self.fused_queries.current():
            return
        self.fused_queries = FusedLinear(projections, copy) if worth_stacking(projections) else None

    def project_queries(self, q_latent: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(q_b(q_latent), wq_b(q_latent)) from the stacked GEMM, or (None, None) where they run apart (each then
        where it is used)."""
        fused = self.fused_queries
        if fused is not None and not fused.current():  # a parameter was replaced since (device move, reload)
            self.fuse_query_projections(copy=True)
            fused = self.fused_queries
        if fused is None:
            return None, None
        q, index_q = fused(q_latent)
        return q, index_q

    def fp8_input_shape(self) -> tuple[int, int] | None:
        """(N, K) of the block-FP8 GEMM that reads the layer's input (q_a, the indexer's wk and kv_a stacked), or
        None where they are not one FP8 GEMM."""
        fused = self.fused_inputs
        if fused is None or fused.stacked.get("weight_scale_inv") is None:
            return None
        return tuple(fused.stacked["weight"].shape)

    def absorbed_fp8_fits(self) -> bool:
        """Whether a block-FP8 kv_b_proj can serve the absorbed products in FP8 as it is stored: 128×128 blocks
        and every head's nope rows, v rows and the latent columns whole blocks (DeepSeek-V3.2: 128 / 128 / 512).
        GLM-5's heads (nope 192, v 256) cut through blocks: its W_UK / W_UV are dequantized instead."""
        block = self.kv_b_proj.weight_block
        return (self.kv_b_proj.fp8_scale is not None and tuple(block) == (128, 128)
                and self.nope_dim % 128 == 0 and self.v_dim % 128 == 0 and self.kv_lora_rank % 128 == 0)

    @torch.no_grad()
    def absorb_weights(self) -> None:
        """Split kv_b_proj per head into W_UK and W_UV once (after loading; the weight itself is kept).

        Block-FP8 kv_b_proj whose heads are whole blocks (`absorbed_fp8_fits`): the products run as batched
        block-FP8 GEMMs (kernels/fp8_bmm_triton.py, the activations quantized per 128 channels inside) on the
        checkpoint's own values — W_UV is a view of kv_b_proj's rows, W_UKᵀ a transposed FP8 copy (the kernel reads
        the reduction dimension contiguously), a quarter of the two bf16 matrices' bytes. SGLang offers the same
        with DeepGEMM (SGLANG_USE_DEEPGEMM_BMM); without it, and here for other layouts, kv_b_proj is dequantized
        into the model dtype for bf16 batched matmuls."""
        w = self.kv_b_proj.weight
        scale = self.kv_b_proj.fp8_scale
        heads, nope, lora = self.num_heads, self.nope_dim, self.kv_lora_rank
        self.absorbed_fp8 = self.absorbed_fp8_fits()
        self.weights_absorbed = True
        if self.absorbed_fp8:
            blocks = scale.view(heads, (nope + self.v_dim) // 128, lora // 128)
            w = w.view(heads, nope + self.v_dim, lora)
            self._fill_absorbed("w_uk", w[:, :nope].transpose(1, 2))
            self._fill_absorbed("w_uk_scale", blocks[:, : nope // 128].transpose(1, 2))
            self.w_uv = w[:, nope:]
            self.w_uv_scale = blocks[:, nope // 128 :]
            return
        if scale is not None:
            w = dequantize_block_fp8(w, scale, self.kv_b_proj.weight_block).to(self.kv_a_layernorm.weight.dtype)
        w = w.view(heads, nope + self.v_dim, lora)
        self._fill_absorbed("w_uk", w[:, :nope])
        self._fill_absorbed("w_uv", w[:, nope:])
        self.w_uk_scale = self.w_uv_scale = torch.empty(0, device=w.device)

    def absorbed_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each tensor `absorb_weights` copies out of kv_b_proj (the FP8 path's W_UV and its
        scales are views and need no storage)."""
        heads, nope, lora = self.num_heads, self.nope_dim, self.kv_lora_rank
        if self.absorbed_fp8_fits():
            return {"w_uk": ((heads, lora, nope), self.kv_b_proj.weight.dtype),
                    "w_uk_scale": ((heads, lora // 128, nope // 128), self.kv_b_proj.fp8_scale.dtype)}
        dtype = self.kv_a_layernorm.weight.dtype if self.kv_b_proj.fp8_scale is not None else self.kv_b_proj.weight.dtype
        return {"w_uk": ((heads, nope, lora), dtype), "w_uv": ((heads, self.v_dim, lora), dtype)}

    def reserve_absorbed(self) -> None:
        """Give the absorbed copies their storage at construction, beside the layer's other tensors, so that
        `absorb_weights` fills them in place (and a reload keeps their addresses): allocated after loading
        instead, each 8-16 MB copy split a larger caching-allocator segment freed before it (replaced parameters,
        the random fill's temporaries) and stranded the rest of it — ~350 MiB over DeepSeek-V3.2's 61 layers on one
        EP8 rank, KV the budget, measured from free device memory, never got
        (tests/model/test_construct_memory_gpu.py)."""
        device = self.kv_b_proj.weight.device
        for name, (shape, dtype) in self.absorbed_layout().items():
            setattr(self, name, torch.empty(shape, dtype=dtype, device=device))

    def _fill_absorbed(self, name: str, value: torch.Tensor) -> None:
        """Copy `value` into the buffer `name` where `reserve_absorbed` gave it the right storage (same bits as a
        fresh copy), else make it a contiguous copy."""
        buffer = getattr(self, name)
        if buffer.shape == value.shape and buffer.dtype == value.dtype and buffer.device == value.device:
            buffer.copy_(value)
        else:
            setattr(self, name, value.contiguous())

    def latent_rows(self, kv_a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The cache rows [T, 576] = [RMSNorm(c_kv) ; RoPE(k_pe)] of the new tokens, from kv_a_proj_with_mqa(x)."""
        rank = self.kv_lora_rank
        rows = torch.empty(kv_a.shape[0], rank + self.rope_dim,
                           dtype=torch.result_type(self.kv_a_layernorm.weight, kv_a), device=kv_a.device)
        self.kv_a_layernorm(kv_a[:, :rank], out=rows[:, :rank])
        fused_ops.rope(kv_a[:, rank:], cos, sin, interleaved=True, out=rows[:, rank:])
        return rows

    def absorbed_query(self, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       q_proj: torch.Tensor | None = None) -> torch.Tensor:
        """[T, H, 576] = [W_UKᵀ q_nope ; RoPE(q_pe)] per head (its intermediates die on return). q_proj: q_b's
        output where the stacked query GEMM made it (a column slice), else computed here."""
        num_tokens = q_latent.shape[0]
        q = (self.q_b_proj(q_latent) if q_proj is None else q_proj).view(num_tokens, self.num_heads,
                                                                          self.nope_dim + self.rope_dim)
        query = torch.empty(num_tokens, self.num_heads, self.kv_lora_rank + self.rope_dim, dtype=q.dtype,
                            device=q.device)
        if self.absorbed_fp8:  # written straight into the query's first 512 columns, per head: no temporary
            fp8_batched_matmul(q[..., : self.nope_dim].transpose(0, 1), self.w_uk, self.w_uk_scale,
                               query[..., : self.kv_lora_rank].transpose(0, 1))
        else:  # W_UKᵀ q_nope per head, in token chunks so the temporary stays small for long prefills
            for start in range(0, num_tokens, _ABSORB_CHUNK_TOKENS):
                rows = slice(start, start + _ABSORB_CHUNK_TOKENS)
                latent = batched_matmul(q[rows, :, : self.nope_dim].transpose(0, 1), self.w_uk)  # [H, t, 512]
                query[rows, :, : self.kv_lora_rank] = latent.transpose(0, 1)
        fused_ops.rope(q[..., self.nope_dim :], cos, sin, interleaved=True, out=query[..., self.kv_lora_rank :])
        return query

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cos32: torch.Tensor, sin32: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden] → [T, hidden] (a layer that runs its own indexer)."""
        return self.forward_with_topk(x, cos, sin, cos32, sin32)[0]

    def forward_with_topk(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cos32: torch.Tensor, sin32: torch.Tensor,
        shared_topk: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] → ([T, hidden], top-k positions [T, K] it attended). cos/sin in x's dtype (MLA),
        cos32/sin32 float32 (indexer). A shared layer (no indexer) attends over `shared_topk`."""
        if not self.weights_absorbed:
            raise RuntimeError("MLAAttention.absorb_weights() was not called after loading the weights")
        backend = get_forward_context().backend
        num_tokens = x.shape[0]

        q_a, index_k, kv_a = self.project_inputs(x)
        q_latent = self.q_a_layernorm(q_a)
        del q_a
        q_proj, index_q = self.project_queries(q_latent)
        # The selection first: the backend starts fetching what it selected (HiSparse: this layer's swap-in) while
        # the query and KV-row projections below run (docs/engine.md "The HiSparse step").
        if self.indexer is not None:
            index = self.indexer(x, q_latent, cos32, sin32, index_k, index_q)
            backend.write_index_keys(self.layer_id, index.keys_fp8, index.key_scales)
            positions = backend.index_topk(self.layer_id, index.q, index.weights, self.index_topk)
            del index
        elif shared_topk is None:
            raise RuntimeError(f"layer {self.layer_id} shares the top-k of a previous full layer, but none ran")
        else:
            positions = shared_topk
        backend.prepare_attention(self.layer_id, positions)
        query = self.absorbed_query(q_latent, cos, sin, q_proj)
        del q_latent, q_proj
        backend.write_kv(self.layer_id, self.latent_rows(kv_a, cos, sin))
        del kv_a
        latent_out = backend.sparse_attention(self.layer_id, query, positions, self.softmax_scale)  # [T, H, 512]
        del query
        # [H, T, 512] @ [H, 512, v] → [H, T, v] → [T, H·v]
        if self.absorbed_fp8:  # written straight into o_proj's input [T, H, v]
            out = x.new_empty(num_tokens, self.num_heads, self.v_dim)
            fp8_batched_matmul(latent_out.transpose(0, 1), self.w_uv, self.w_uv_scale, out.transpose(0, 1))
            del latent_out
            return self.o_proj(out.view(num_tokens, self.num_heads * self.v_dim)), positions
        out = batched_matmul(latent_out.to(self.w_uv.dtype).transpose(0, 1), self.w_uv.transpose(1, 2))
        del latent_out
        return self.o_proj(out.transpose(0, 1).reshape(num_tokens, self.num_heads * self.v_dim)), positions
