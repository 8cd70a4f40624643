"""Shared helpers for the model tests: a brute-force attention backend and forward-pass drivers.

`ListBackend` implements the attention-backend contract as literally as possible (per-request tensors, one
query at a time) in whatever dtype the model runs, float64 included, so model tests do not depend on the
engine's backends and can compare against float64 references.
"""

from __future__ import annotations

import torch

from decode_server.engine.attention_backend import AttentionBackend
from decode_server.engine.forward_batch import ForwardBatch
from decode_server.engine.forward_context import forward_context
from kernels.indexer_ref import index_scores_ref
from kernels.topk_ref import topk_positions_ref


class ListBackend(AttentionBackend):
    """`d_v`: width of the latent output (the model's kv_lora_rank; 512 for DeepSeek-V3.2 and GLM-5)."""

    def __init__(self, d_v: int = 512) -> None:
        self.d_v = d_v
        self.kv: dict[tuple[int, int], torch.Tensor] = {}
        self.keys: dict[tuple[int, int], torch.Tensor] = {}
        self.scales: dict[tuple[int, int], torch.Tensor] = {}
        self.batch: ForwardBatch | None = None
        self.topk_log: list[tuple[int, torch.Tensor]] = []

    def begin_forward(self, batch: ForwardBatch) -> None:
        self.batch = batch

    def end_forward(self, batch: ForwardBatch) -> None:
        self.batch = None

    def _spans(self):
        assert self.batch is not None
        start = 0
        for b, (row, prefix, ext) in enumerate(
            zip(self.batch.req_rows_cpu, self.batch.prefix_lens_cpu, self.batch.extend_lens_cpu, strict=True)
        ):
            yield b, row, prefix, slice(start, start + ext)
            start += ext

    @staticmethod
    def _append(store: dict, key: tuple[int, int], prefix: int, new: torch.Tensor) -> None:
        old = store.get(key)
        kept = old[:prefix] if old is not None else new[:0]
        assert kept.shape[0] == prefix, "prefix longer than what was written before"
        store[key] = torch.cat((kept, new), dim=0)

    def write_kv(self, layer_id: int, kv_rows: torch.Tensor) -> None:
        for _, row, prefix, span in self._spans():
            self._append(self.kv, (layer_id, row), prefix, kv_rows[span].clone())

    def write_index_keys(self, layer_id: int, keys_fp8: torch.Tensor, scales: torch.Tensor) -> None:
        for _, row, prefix, span in self._spans():
            self._append(self.keys, (layer_id, row), prefix, keys_fp8[span].clone())
            self._append(self.scales, (layer_id, row), prefix, scales[span].clone())

    def index_topk(self, layer_id: int, q: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
        out = torch.full((q.shape[0], top_k), -1, dtype=torch.int32)
        for _, row, prefix, span in self._spans():
            keys, scales = self.keys[(layer_id, row)], self.scales[(layer_id, row)]
            for i, t in enumerate(range(span.start, span.stop)):
                n = prefix + i + 1
                if n <= top_k:
                    out[t, :n] = torch.arange(n, dtype=torch.int32)
                else:
                    s = index_scores_ref(q[t : t + 1], weights[t : t + 1], keys[:n], scales[:n])
                    # The engine's selection rule (ties to the lower position): small random models score
                    # many positions exactly 0, where torch.topk's choice among equals is arbitrary.
                    out[t] = topk_positions_ref(s, torch.tensor([n]), top_k)[0]
        self.topk_log.append((layer_id, out.clone()))
        return out

    def sparse_attention(
        self, layer_id: int, q: torch.Tensor, topk_positions: torch.Tensor, softmax_scale: float
    ) -> torch.Tensor:
        out = torch.zeros(q.shape[0], q.shape[1], self.d_v, dtype=q.dtype)
        for _, row, _, span in self._spans():
            kv = self.kv[(layer_id, row)]
            for t in range(span.start, span.stop):
                sel = topk_positions[t][topk_positions[t] >= 0].long()
                rows = kv[sel].to(q.dtype)
                probs = torch.softmax((q[t] @ rows.T) * softmax_scale, dim=-1)
                out[t] = probs @ rows[:, : self.d_v]
        return out


def forward_tokens(model, backend, req_rows, prefix_lens, token_lists) -> torch.Tensor:
    """One forward pass extending each request by its tokens; returns hidden [T, hidden]."""
    batch = ForwardBatch.build(req_rows, prefix_lens, [len(t) for t in token_lists], model.device)
    ids = torch.tensor([tok for toks in token_lists for tok in toks], dtype=torch.int64, device=model.device)
    with forward_context(batch, backend):
        return model(ids, batch.positions)


def prefill_logits(model, backend, tokens: list[int], req_row: int = 0) -> torch.Tensor:
    """Logits [len(tokens), vocab] of a whole prompt in one pass."""
    return model.compute_logits(forward_tokens(model, backend, [req_row], [0], [tokens]))


def small_config_dict(**overrides) -> dict:
    """Real row format (512 + 64, 128-dim indexer) with every other size tiny: fast float64 tests."""
    raw = {
        "model_type": "deepseek_v32", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
        "moe_intermediate_size": 32, "num_hidden_layers": 2, "first_k_dense_replace": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 8,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
        "routed_scaling_factor": 2.5, "index_n_heads": 4, "index_head_dim": 128, "index_topk": 8,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1,
                            "mscale": 1.0, "mscale_all_dim": 1.0},
    }
    raw.update(overrides)
    return raw


def small_model(dtype=torch.float64, seed: int = 0, **overrides):
    from decode_server.model import ModelConfig, build_random_model

    config = ModelConfig.from_dict(small_config_dict(**overrides))
    return build_random_model(config, "cpu", dtype, seed=seed)


def dense_backend(config, num_slots: int = 4096, max_requests: int = 8, max_context: int = 4096,
                  kv_dtype=torch.float32, device="cpu"):
    """The engine's DenseBackend over a small cache (the backend the engine runs on CPU)."""
    from decode_server.engine.dense_backend import DenseBackend, DenseKVCache
    from decode_server.engine.kv_rows import CacheGeometry

    cache = DenseKVCache(config.num_hidden_layers, num_slots, max_requests, max_context, kv_dtype, device,
                         geometry=CacheGeometry.from_model_config(config))
    return DenseBackend(cache)


def greedy_generate(model, backend, prompt: list[int], steps: int, req_row: int = 0) -> list[int]:
    """Prefill the prompt, then decode `steps` tokens greedily, one forward pass per token."""
    backend.reserve(req_row, len(prompt) + steps)
    logits = model.compute_logits(forward_tokens(model, backend, [req_row], [0], [prompt])[-1:])
    out = [int(logits.argmax())]
    while len(out) < steps:
        hidden = forward_tokens(model, backend, [req_row], [len(prompt) + len(out) - 1], [[out[-1]]])
        out.append(int(model.compute_logits(hidden).argmax()))
    backend.release(req_row)
    return out
