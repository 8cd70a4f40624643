"""DeepSeek-V3.2 / GLM-5 causal LM: embeddings, decoder layers (MLA + DSA indexer, dense MLP or MoE), final
norm, head. GLM-5's "shared" layers take the top-k positions of the previous full layer (carried down the stack).

Module and parameter names mirror the Hugging Face checkpoints (`model.layers.N.self_attn.q_a_proj.weight`,
`model.layers.N.mlp.experts.E.gate_proj.weight`, ...), so the loader maps tensors by name.
"""

from __future__ import annotations

import torch
from torch import nn

from decode_server.model.attention import MLAAttention
from decode_server.model.batch_invariant import Linear
from decode_server.model.config import ModelConfig
from decode_server.model.layers import MLP, RMSNorm
from decode_server.model.moe import MoE
from decode_server.model.rope import RotaryEmbedding
from decode_server.parallel import layers as parallel_layers
from decode_server.parallel.dp_attention import (
    current_layout,
    dp_combine,
    dp_gather,
    dp_gather_sampled,
    dp_own_sampled,
)
from decode_server.parallel.state import ParallelState, resolve
from kernels.fp8_gemm import reads_quantized_input


class DecoderLayer(nn.Module):
    """Attention, then the MLP (dense or MoE), each with its residual.

    With data-parallel attention (`parallel.dp_attention`) attention is this rank's alone (all heads, its own
    tokens and KV) and the MLP is sharded across every rank as under tensor parallelism, over every rank's tokens:
    gathered before it, its partial outputs reduce-scattered back to their owners after it. A rank with no token
    in the pass (idle) skips attention and still joins the MLP's collectives."""

    def __init__(self, config: ModelConfig, layer_id: int, parallel: ParallelState) -> None:
        super().__init__()
        self.parallel = parallel
        self.dp_attention = parallel.dp_attention
        reduce = not self.dp_attention  # DP attention: the layer combines the ranks' partials (dp_combine)
        self.self_attn = MLAAttention(config, layer_id, parallel.attention_state())
        self.mlp: nn.Module = (
            MoE(config, parallel, reduce=reduce) if config.is_moe_layer(layer_id)
            else MLP(config.hidden_size, config.intermediate_size, parallel, reduce=reduce)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, ...], shared_topk: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn_in_fp8 = _reads_quantized(self.self_attn, x)
        if not self.dp_attention:
            attn_out, topk = self.self_attn.forward_with_topk(self.input_layernorm(x, quantize=attn_in_fp8), *rope,
                                                              shared_topk=shared_topk)  # fmt: skip
            x, normed = self.post_attention_layernorm.add_forward(x, attn_out, quantize=_reads_quantized(self.mlp, x))
            return x + self.mlp(normed), topk
        topk = shared_topk
        if x.shape[0]:  # an idle rank has nothing to attend (and no batch installed)
            attn_out, topk = self.self_attn.forward_with_topk(self.input_layernorm(x, quantize=attn_in_fp8), *rope,
                                                              shared_topk=shared_topk)  # fmt: skip
            x = x + attn_out
        everyone = dp_gather(self.post_attention_layernorm(x), self.parallel)
        return x + dp_combine(self.mlp(everyone), self.parallel), topk


def _reads_quantized(consumer: nn.Module, x: torch.Tensor) -> bool:
    """Whether the norm before `consumer` (attention or MLP / MoE) should also write its output in block FP8: the
    consumer's first projection is one FP8 GEMM whose chosen kernel for x's row count reads quantized
    activations (kernels/fp8_gemm.py `reads_quantized_input`), so the norm spares it a quantization launch."""
    if not x.is_cuda:
        return False
    shape = consumer.fp8_input_shape()
    return shape is not None and reads_quantized_input(*shape, x.shape[0], x.dtype, x.device)


class DSAModel(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelState) -> None:
        super().__init__()
        # Replicated with DP attention (each rank embeds its own tokens), as SGLang does.
        self.embed_tokens = parallel_layers.embedding(config.vocab_size, config.hidden_size,
                                                      parallel.attention_state())  # fmt: skip
        self.layers = nn.ModuleList(DecoderLayer(config, i, parallel) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.rope, config.qk_rope_head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos32, sin32 = self.rotary(positions, torch.float32)
        rope = (cos32.to(x.dtype), sin32.to(x.dtype), cos32, sin32)
        topk: torch.Tensor | None = None
        for layer in self.layers:
            x, topk = layer(x, rope, topk)
        return self.norm(x)


class DSAForCausalLM(nn.Module):
    """`forward(input_ids[T], positions[T]) -> hidden[T, hidden]` inside a forward context (it reads
    `get_forward_context()` in every attention layer); `compute_logits(hidden[B, hidden]) -> [B, vocab] f32`.

    `parallel` (None = one device) makes this one tensor-parallel rank's shard (docs/parallelism.md): `forward`
    is called identically on every rank, and `compute_logits` returns the full vocabulary on every rank.
    With data-parallel attention every rank calls `forward` and `compute_logits` on its own tokens (possibly none)
    in every pass, inside `parallel.dp_attention.dp_batch` (everyone's counts); `compute_logits` returns this
    rank's rows, full vocabulary."""

    def __init__(self, config: ModelConfig, parallel: ParallelState | None = None) -> None:
        super().__init__()
        self.config = config
        self.parallel = resolve(parallel)
        self.model = DSAModel(config, self.parallel)
        # DP attention: the head is vocab-parallel over every rank's sampled rows (gathered), as SGLang does by
        # default; whole on every rank with --enable-dp-lm-head, or when it is the (replicated) embedding.
        self.dp_gathered_head = self.parallel.dp_attention and not (self.parallel.enable_dp_lm_head
                                                                    or config.tie_word_embeddings)
        head_state = self.parallel if self.dp_gathered_head or not self.parallel.dp_attention else \
            self.parallel.attention_state()
        self.lm_head: Linear = parallel_layers.lm_head(config.hidden_size, config.vocab_size, head_state)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def kv_row_dim(self) -> int:
        return self.config.kv_row_dim

    @property
    def index_head_dim(self) -> int:
        return self.config.index_head_dim

    @property
    def index_topk(self) -> int:
        return self.config.index_topk

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def attention_layers(self) -> list[MLAAttention]:
        return [layer.self_attn for layer in self.model.layers]

    @torch.no_grad()
    def finalize_weights(self) -> None:
        """Derived tensors that loading must refresh: tied head, absorbed MLA up-projections, the stacked input
        and gate/up projections (restacked only if a parameter was replaced since construction)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for attn in self.attention_layers():
            attn.absorb_weights()
            attn.fuse_input_projections()
            attn.fuse_query_projections()
        for module in self.modules():
            if isinstance(module, MLP):
                module.fuse_gate_up()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.dp_gathered_head:
            if sum(current_layout().num_sampled) == 0:  # no rank samples in this pass: all skip the collectives
                return hidden.new_empty((0, self.config.vocab_size), dtype=torch.float32)
            return dp_own_sampled(self.lm_head(dp_gather_sampled(hidden, self.parallel))).float()
        return self.lm_head(hidden).float()
