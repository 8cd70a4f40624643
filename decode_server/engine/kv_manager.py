"""What the scheduler asks of KV memory, whatever the mode: admit, grow, retract, resume, free, report.

Two implementations: `DenseKVManager` (all KV on the device) and
`decode_server.hisparse.coordinator.HiSparseCoordinator` (host pool + device buffers + GPU indexer keys). In both,
KV grows page by page with the sequence: admission takes pages for the prompt and the first generated token,
`ensure_room` adds a page when a request needs one, and a request that cannot get one is retracted (its KV moved
out of the budgeted pools into private host memory) and resumed later, bit for bit, without recomputation.
Both expose the `AttentionBackend` the model uses.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from decode_server.engine.attention_backend import AttentionBackend
from decode_server.engine.types import HiSparseLayerStats, PoolUsage


class KVManager(ABC):
    backend: AttentionBackend
    supports_retraction: bool = False

    @abstractmethod
    def capacity_error(self, prompt_len: int, max_total_len: int) -> str | None:
        """Why a request of this size could never run, even alone; None when it can."""

    @property
    @abstractmethod
    def page_size(self) -> int:
        """Tokens per page of every growing pool."""

    @property
    @abstractmethod
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + generated − 1) one request can ever hold, alone in the cache."""

    @abstractmethod
    def free_pages(self) -> int:
        """Free pages of the binding growing pool (the one with the fewest)."""

    @abstractmethod
    def pages_needed(self, req_row: int, num_tokens: int) -> int:
        """Pages `req_row` still lacks to hold `num_tokens` tokens (in the pool that lacks the most)."""

    def can_start_request(self) -> bool:
        """Whether the fixed per-request resources (HiSparse: a device buffer) are free now."""
        return True

    @abstractmethod
    def try_admit(self, req_row: int, prompt_len: int, max_total_len: int) -> bool:
        """Take what the request needs to prefill and sample its first token (pages for prompt + 1 tokens, and
        the fixed per-request resources); False = not now."""

    @abstractmethod
    def ensure_room(self, req_row: int, num_tokens: int) -> bool:
        """Grow the request to hold `num_tokens` tokens; False when memory is short (the scheduler retracts)."""

    def finish_prefill(self, req_row: int, num_tokens: int) -> None:  # noqa: B027 - optional hook
        """The prompt's KV is complete: move it to where decode reads it (HiSparse: preload the buffer)."""

    def retract(self, req_row: int, num_tokens: int) -> None:
        raise RuntimeError(f"{type(self).__name__} does not retract")

    def try_resume(self, req_row: int, num_tokens: int) -> bool:
        raise RuntimeError(f"{type(self).__name__} does not retract")

    @abstractmethod
    def free(self, req_row: int) -> None:
        """Release everything the request holds (finish and abort)."""

    @abstractmethod
    def usage(self) -> dict[str, PoolUsage]:
        """Pool name → usage; names are `EngineStats` fields."""

    @abstractmethod
    def token_usage(self) -> float:
        """Fraction of the binding pool in use (SGLang's `token_usage`)."""

    def layer_stats(self) -> list[HiSparseLayerStats]:
        return []

    @abstractmethod
    def is_empty(self) -> bool:
        """True when nothing is allocated (the engine asserts it when idle in tests)."""
