"""What the scheduler asks of KV memory, whatever the mode: admit, grow, retract, resume, free, report.

Two implementations: `DenseKVManager` (all KV on the device; reserves prompt + max_tokens at admission, so it
never needs retraction) and `decode_server.hisparse.coordinator.HiSparseCoordinator` (host pool + device buffers
+ GPU indexer keys; retracts under indexer-key pressure). Both expose the `AttentionBackend` the model uses.
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

    @abstractmethod
    def try_admit(self, req_row: int, prompt_len: int, max_total_len: int) -> bool:
        """Take what the request needs to prefill (and, where the mode reserves it, to finish); False = wait."""

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
