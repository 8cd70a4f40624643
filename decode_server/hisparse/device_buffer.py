"""Device KV buffer pool: a fixed number of per-request buffers of D LRU positions + R recent (ring) slots.

Slot ids are the same in every layer; which token a slot holds is per layer (`buffer_tokens`), because every
layer's indexer picks different tokens. Buffers are contiguous runs of `D + R` slots, so admission is one pop
from a free list and `buffer_slots[r]` is an arange.
"""

from __future__ import annotations

import logging

import torch

from decode_server.engine.forward_batch import SCRATCH_SLOTS, map_scratch_row

logger = logging.getLogger(__name__)


class DeviceBufferPool:
    def __init__(
        self,
        num_layers: int,
        num_buffers: int,
        buffer_size: int,
        num_recent: int,
        row_bytes: int,
        max_reqs: int,
        device: torch.device,
    ) -> None:
        if num_buffers < 1:
            raise ValueError("the device KV budget does not hold a single request buffer")
        self.num_layers = num_layers
        self.buffer_size = buffer_size  # D
        self.num_recent = num_recent  # R
        self.slots_per_buffer = buffer_size + num_recent
        self.num_buffers = num_buffers
        self.row_bytes = row_bytes
        self.device = device
        num_slots = num_buffers * self.slots_per_buffer
        # SCRATCH_SLOTS slots past the buffers and one more request row (the scratch row, whose only slot is the
        # first scratch slot): padded rows of static decode batches write their token there and, their top-k
        # masked, read nothing (forward_batch.SCRATCH_SLOTS).
        self.kv = torch.zeros((num_layers, num_slots + SCRATCH_SLOTS, row_bytes), dtype=torch.uint8, device=device)
        self.scratch_row = max_reqs
        rows = max_reqs + 1
        self.buffer_slots = torch.full((rows, self.slots_per_buffer), -1, dtype=torch.int32, device=device)
        map_scratch_row(self.buffer_slots, self.scratch_row, num_slots)
        self.buffer_tokens = torch.full((num_layers, rows, buffer_size), -1, dtype=torch.int32, device=device)
        self._identity = torch.arange(buffer_size, dtype=torch.int32, device=device)
        self.lru_order = self._identity.repeat(num_layers, rows, 1).contiguous()
        self._free: list[int] = list(range(num_buffers - 1, -1, -1))
        self._owner: dict[int, int] = {}  # req_row -> buffer id
        logger.info(
            "device KV buffers: %d x (%d + %d) slots x %d layers x %d B = %.1f MiB",
            num_buffers, buffer_size, num_recent, num_layers, row_bytes, self.kv.numel() / 2**20,
        )

    @property
    def free_buffers(self) -> int:
        return len(self._free)

    @property
    def used_buffers(self) -> int:
        return self.num_buffers - len(self._free)

    @property
    def nbytes(self) -> int:
        return self.kv.numel()

    def has(self, req_row: int) -> bool:
        return req_row in self._owner

    def allocate(self, req_row: int) -> None:
        """Give the request a buffer; its LRU state starts empty (no token held, order = identity)."""
        if req_row in self._owner:
            raise RuntimeError(f"request row {req_row} already owns a device buffer")
        if not self._free:
            raise MemoryError("no free device buffer")
        buf = self._free.pop()
        self._owner[req_row] = buf
        start = buf * self.slots_per_buffer
        self.buffer_slots[req_row] = torch.arange(
            start, start + self.slots_per_buffer, dtype=torch.int32, device=self.device
        )
        self.buffer_tokens[:, req_row] = -1
        self.lru_order[:, req_row] = self._identity

    def free(self, req_row: int) -> None:
        buf = self._owner.pop(req_row, None)
        if buf is None:
            return
        self._free.append(buf)
        self.buffer_slots[req_row] = -1
        self.buffer_tokens[:, req_row] = -1
        self.lru_order[:, req_row] = self._identity

    def slot_of_new_token(self, req_row: int, position: int) -> int:
        """Where the token at `position` is written (seq_len = position + 1): identity or its ring slot."""
        start = self._owner[req_row] * self.slots_per_buffer
        if position < self.buffer_size:
            return start + position
        return start + self.buffer_size + position % self.num_recent
