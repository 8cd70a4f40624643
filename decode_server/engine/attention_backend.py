"""The interface between the DSA model and KV memory.

Per layer, the model computes (for the T new tokens of a `ForwardBatch`):
  - the MLA cache row `[c_kv (512, normalized) ; k_pe (64, roped)]` of each new token,
  - the lightning-indexer key of each new token, already packed as FP8 e4m3 [T, 128] + fp32 scale [T],
  - the indexer query [T, Hi, 128] and per-head weights [T, Hi] (all scale factors folded in),
  - the absorbed MLA query [T, H, 576].
It then calls, in this order: `write_index_keys`, `index_topk`, `prepare_attention`, `write_kv`,
`sparse_attention`: the selection first, so that a backend can start fetching the selected rows
(`prepare_attention`) while the model computes the query and the new KV row; a layer without its own indexer
skips the first two and prepares with the top-k it reuses.

Positions returned by `index_topk` are logical token positions inside each request (−1 = padding); each
backend maps them to its own physical rows. Both backends run the same sparse attention over the same rows
in the same order, which is what makes HiSparse bit-identical to dense.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from decode_server.engine.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Owns (or references) the KV memory that the model reads and writes through the forward context."""

    # Sparse MLA kernel on CUDA ("triton" or "flashmla", see kernels.sparse_mla_decode); the engine sets it from
    # --attention-backend. Dense and HiSparse get the same value, so both modes run the same kernel.
    attention_kernel: str = "triton"
    # The extra request row of every table that padded rows of static decode batches use; −1: none (the backend
    # cannot run padded batches, so no CUDA graphs).
    scratch_row: int = -1

    def begin_forward(self, batch: ForwardBatch) -> None:  # noqa: B027 - optional hook
        """Called once before the first layer (e.g. to compute physical row tables for the batch)."""

    def end_forward(self, batch: ForwardBatch) -> None:  # noqa: B027 - optional hook
        """Called once after the last layer (e.g. to launch the backup of the new tokens' rows)."""

    def prepare_static_forward(self, batch: ForwardBatch) -> None:  # noqa: B027 - optional hook
        """Host side of `begin_forward` for a static (padded, maybe replayed) decode batch: checks and stream
        waits that cannot be captured. Called before every replay or eager run of such a batch."""

    def finish_static_forward(self, batch: ForwardBatch, num_real: int) -> None:  # noqa: B027 - optional hook
        """Host side of `end_forward` for a static batch, after its replay: only the first `num_real` rows are
        requests."""

    def prepare_attention(self, layer_id: int, topk_positions: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """The layer's selection is known: start whatever its `sparse_attention` will need of memory (HiSparse:
        the swap-in). The model passes the very tensor it will hand to `sparse_attention`."""

    @abstractmethod
    def write_kv(self, layer_id: int, kv_rows: torch.Tensor) -> None:
        """Store the new tokens' MLA rows [T, 576] (model dtype) for `layer_id`."""

    @abstractmethod
    def write_index_keys(self, layer_id: int, keys_fp8: torch.Tensor, scales: torch.Tensor) -> None:
        """Store the new tokens' indexer keys: [T, 128] float8_e4m3fn and [T] float32 scales."""

    @abstractmethod
    def index_topk(
        self, layer_id: int, q: torch.Tensor, weights: torch.Tensor, top_k: int
    ) -> torch.Tensor:
        """Top-k logical positions [T, top_k] int32 (−1 pads) per new token over its causal prefix.

        `q` is [T, Hi, 128] float32 (or float8_e4m3fn, its heads scaled by powers of two whose inverses are in
        the weights: `fused_ops.index_query`), `weights` is [T, Hi] float32. When a token's prefix (itself included) has
        at most `top_k` tokens, the result is every position 0..p in ascending order, then −1s.
        """

    @abstractmethod
    def sparse_attention(
        self, layer_id: int, q: torch.Tensor, topk_positions: torch.Tensor, softmax_scale: float
    ) -> torch.Tensor:
        """Sparse MLA over the selected rows: q [T, H, 576] → latent output [T, H, 512] (q's dtype)."""
