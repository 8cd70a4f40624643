"""DeepSeek-V3.2 / GLM-5 causal LM: embeddings, decoder layers (MLA + DSA indexer, dense MLP or MoE), final
norm, head. GLM-5's "shared" layers take the top-k positions of the previous full layer (carried down the stack).

Module and parameter names mirror the Hugging Face checkpoints (`model.layers.N.self_attn.q_a_proj.weight`,
`model.layers.N.mlp.experts.E.gate_proj.weight`, ...), so the loader maps tensors by name.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

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


class MicroBatchHooks(Protocol):
    """What `forward_two_batch` asks of its caller (decode_server/engine/two_batch.py: streams, forward contexts)."""

    def fork(self) -> None:
        """The whole batch's inputs (embeddings, rotary tables) are launched: micro-batch 1 may start."""

    def enter(self, index: int) -> AbstractContextManager[None]:
        """The scope of one layer of micro-batch `index`."""

    def join(self) -> None:
        """Every layer of both micro-batches is launched: what follows reads both."""


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

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Token embeddings [T, hidden] and the rotary tables (cos, sin in the model dtype; cos, sin float32)."""
        x = self.embed_tokens(input_ids)
        cos32, sin32 = self.rotary(positions, torch.float32)
        return x, (cos32.to(x.dtype), sin32.to(x.dtype), cos32, sin32)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, rope = self.embed(input_ids, positions)
        topk: torch.Tensor | None = None
        for layer in self.layers:
            x, topk = layer(x, rope, topk)
        return self.norm(x)

    def forward_two_batch(
        self, input_ids: torch.Tensor, positions: torch.Tensor, split: int, hooks: MicroBatchHooks
    ) -> torch.Tensor:
        """`forward` with the tokens cut at `split` into two micro-batches whose layers run in alternation: layer L
        of micro-batch 0, layer L of micro-batch 1, layer L+1 of micro-batch 0, ... Each layer of micro-batch i runs
        inside `hooks.enter(i)`; `hooks.fork()` comes after the embeddings and `hooks.join()` once every layer is
        launched, before the final norm of the whole batch (the embeddings and rotary tables, which both
        micro-batches read, stay alive until then). GLM-5 shared layers get their own micro-batch's top-k."""
        x, rope = self.embed(input_ids, positions)
        hooks.fork()
        parts = [(x[:split], tuple(r[:split] for r in rope)), (x[split:], tuple(r[split:] for r in rope))]
        hidden = [part[0] for part in parts]
        topk: list[torch.Tensor | None] = [None, None]
        for layer in self.layers:
            for i, (_, part_rope) in enumerate(parts):
                with hooks.enter(i):
                    hidden[i], topk[i] = layer(hidden[i], part_rope, topk[i])
        hooks.join()
        return self.norm(torch.cat(hidden))


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
    def forward_two_batch(
        self, input_ids: torch.Tensor, positions: torch.Tensor, split: int, hooks: MicroBatchHooks
    ) -> torch.Tensor:
        """`forward` as two alternating micro-batches (two-batch overlap, decode_server/engine/two_batch.py)."""
        return self.model.forward_two_batch(input_ids, positions, split, hooks)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
