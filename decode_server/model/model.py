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
from decode_server.parallel.state import ParallelState, resolve


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, parallel: ParallelState) -> None:
        super().__init__()
        self.self_attn = MLAAttention(config, layer_id, parallel)
        self.mlp: nn.Module = (
            MoE(config, parallel) if config.is_moe_layer(layer_id)
            else MLP(config.hidden_size, config.intermediate_size, parallel)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, ...], shared_topk: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn_out, topk = self.self_attn.forward_with_topk(self.input_layernorm(x), *rope, shared_topk=shared_topk)
        x = x + attn_out
        return x + self.mlp(self.post_attention_layernorm(x)), topk


class DSAModel(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelState) -> None:
        super().__init__()
        self.embed_tokens = parallel_layers.embedding(config.vocab_size, config.hidden_size, parallel)
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
    is called identically on every rank, and `compute_logits` returns the full vocabulary on every rank."""

    def __init__(self, config: ModelConfig, parallel: ParallelState | None = None) -> None:
        super().__init__()
        self.config = config
        self.parallel = resolve(parallel)
        self.model = DSAModel(config, self.parallel)
        self.lm_head: Linear = parallel_layers.lm_head(config.hidden_size, config.vocab_size, self.parallel)

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
        """Derived tensors that loading must refresh: tied head, absorbed MLA up-projections."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for attn in self.attention_layers():
            attn.absorb_weights()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
