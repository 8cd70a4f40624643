"""Per-layer swap-in counters. Hits/misses are counted on the device by the swap-in kernel (no sync per step);
bytes are derived from them and from the rows copied by the backup, by prefill (prefix staging or gathers, rows
written back) and by preloads."""

from __future__ import annotations

import torch

from decode_server.engine.types import HiSparseLayerStats


class HiSparseCounters:
    def __init__(self, num_layers: int, row_bytes: int, device: torch.device) -> None:
        self.row_bytes = row_bytes
        self.swap = torch.zeros((num_layers, 2), dtype=torch.int64, device=device)  # [hits, misses]
        # The speculative prefetch's swap-ins (a bet on the layer's selection, HiSparseConfig.speculative_prefetch):
        # their misses are rows copied like any other, their hits only confirm what a buffer holds.
        self.speculative = torch.zeros((num_layers, 2), dtype=torch.int64, device=device)
        self.rows_d2h = [0] * num_layers  # backup + prompt staging
        self.rows_h2d_extra = [0] * num_layers  # prefill prefix staging or gathers, buffer preloads (not swap-in misses)

    def add_d2h_all_layers(self, rows: int) -> None:
        for i in range(len(self.rows_d2h)):
            self.rows_d2h[i] += rows

    def add_h2d(self, layer: int, rows: int) -> None:
        self.rows_h2d_extra[layer] += rows

    def snapshot(self) -> list[HiSparseLayerStats]:
        swap = self.swap.cpu().tolist()
        bets = self.speculative.cpu().tolist()
        return [
            HiSparseLayerStats(
                layer=i,
                hits=int(h),
                misses=int(m),
                speculative_hits=int(bh),
                speculative_misses=int(bm),
                bytes_h2d=(int(m) + int(bm) + self.rows_h2d_extra[i]) * self.row_bytes,
                bytes_d2h=self.rows_d2h[i] * self.row_bytes,
            )
            for i, ((h, m), (bh, bm)) in enumerate(zip(swap, bets, strict=True))
        ]
