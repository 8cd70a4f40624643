"""Colocated HiSparse prefill on the device: a two-layer staging area that holds, for the layer being computed,
every row the prefill batch's queries can select, so each chunk's sparse attention runs over device memory as in
dense prefill, with no host sync.

Per prefill forward, the batch's requests get consecutive runs of the staging area in batch order: request b owns
rows `[base_b, base_b + seq_len_b)` and token p of it lives at `base_b + p`. So the indexer's top-k positions map
to staging rows by adding the query's `base` on the device (no `unique`, no gather of selected rows), and the
attention sees the same rows in the same order as dense: bit-identical results.

Per layer l, using buffer `l % 2`:
  stage(l)     prefix rows (tokens of earlier chunks) of every request: host pool → staging on the side stream,
               as bulk copies (copy engines, no SM time) of the runs of consecutive host rows the page lists give
               (one or a few runs for a prompt admitted at once), or, when the rows are scattered over more than
               `max_copy_runs` runs, one UVA gather launch (`kernels.copy_rows`);
  write(l)     the chunk's new rows (computed on the device) → their staging rows, on the compute stream;
  rows(l)      the compute stream waits (on the GPU) for stage(l), then attends over the staging buffer;
  done(l)      on the side stream, after the attention: the new rows staging → host pool (their home; bulk
               copies or one kernel launch, as above), then
               stage(l + 2) into the buffer just freed, so layer l + 2's prefix copy overlaps layer l + 1's compute.
The forward's last side-stream event becomes the coordinator's pending backup (the next forward's stream and any
host-side reader of the pool wait for it, as after a decode step's backup).

Bytes: a chunk copies its requests' prefixes once per layer over PCIe (a 32K prompt in 2K chunks copies
Σ prefix = 16·15/2 · 2K ≈ 246K rows per layer in all, 283 MB of bf16 rows at 1152 B), and writes its own rows
back once. The device holds two layers' worth of the largest batch (`capacity` rows each), budgeted by
`kv_sizing.hisparse_layout`; a larger batch (impossible with the scheduler's chunking and an uncapped default size) takes
the reference path (`HiSparseBackend._extend_attention_gather`).

On CPU the same steps run synchronously with PyTorch copies (the reference of the CUDA path: same layout, same
indices), so the CPU lossless tests exercise this module's logic.
"""

from __future__ import annotations

import contextlib

import torch

import kernels
from decode_server.engine.forward_batch import ForwardBatch
from decode_server.engine.kv_alloc import RequestTokenTable

# Staging rows are allocated in multiples of this (FlashMLA views an FP8 pool as pages of up to 64 rows).
STAGING_ROW_ALIGN = 64
# At most this many bulk copies per layer and direction; rows scattered over more runs take one gather launch.
MAX_COPY_RUNS = 16

Run = tuple[int, int, int]  # (source row, destination row, length)


def staging_bytes(rows: int, row_bytes: int) -> int:
    """Device bytes of a staging area of `rows` rows per buffer (two buffers: one layer computes while the next
    layer's prefix arrives)."""
    return 2 * rows * row_bytes


class PrefillStaging:
    def __init__(self, capacity: int, row_bytes: int, num_layers: int, device: torch.device,
                 stream: torch.cuda.Stream | None) -> None:
        if capacity < 1:
            raise ValueError("prefill staging needs at least one row")
        self.capacity = capacity
        self.num_layers = num_layers
        self.device = device
        self.stream = stream  # side stream for the host copies (CUDA); None: synchronous (CPU)
        # [2, capacity, row_bytes]; buf[i : i + 1] is a one-layer pool for kernels.copy_rows.
        self.buf = torch.empty((2, capacity, row_bytes), dtype=torch.uint8, device=device)
        self.max_copy_runs = MAX_COPY_RUNS
        self._host_kv: torch.Tensor | None = None
        self._pre_src = self._pre_dst = self._new_dst = self._new_host = self._query_base = None
        self._prefix_runs: list[Run] | None = None  # host → staging; None: gather launch with _pre_src/_pre_dst
        self._new_runs: list[Run] | None = None  # staging → host; None: one launch with _new_dst/_new_host
        self._ready: list[torch.cuda.Event | None] = []
        self._written: list[torch.cuda.Event | None] = []
        self._staged: list[bool] = []
        self.prefix_rows = 0  # rows stage() copies per layer in this forward

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    def fits(self, batch: ForwardBatch) -> bool:
        return sum(batch.seq_lens_cpu) <= self.capacity

    # -- per forward --
    def begin(self, batch: ForwardBatch, host_kv: torch.Tensor, host_rows: RequestTokenTable,
              new_host_rows: torch.Tensor) -> None:
        """Lay the batch out and start staging layers 0 and 1. `new_host_rows` [T]: host row of each new token."""
        device = self.device
        bases, total = [], 0
        for seq_len in batch.seq_lens_cpu:
            bases.append(total)
            total += seq_len
        base = torch.tensor(bases, dtype=torch.int64).to(device, non_blocking=True)
        query_base = base[batch.token_req]
        self._query_base = query_base.to(torch.int32).unsqueeze(1)
        self._new_dst = query_base + batch.positions
        prefix_runs: list[Run] = []
        new_runs: list[Run] = []
        for b, (row, prefix, seq_len) in enumerate(zip(batch.req_rows_cpu, batch.prefix_lens_cpu,
                                                       batch.seq_lens_cpu, strict=True)):
            _add_runs(prefix_runs, host_rows.runs(row, 0, prefix), bases[b], host_to_staging=True)
            _add_runs(new_runs, host_rows.runs(row, prefix, seq_len), bases[b] + prefix, host_to_staging=False)
        self.prefix_rows = sum(batch.prefix_lens_cpu)
        on_side: list[torch.Tensor] = [self._new_dst]
        self._prefix_runs = prefix_runs if len(prefix_runs) <= self.max_copy_runs else None
        if self._prefix_runs is None:
            self._pre_src = torch.cat([host_rows.slots(row, prefix) for row, prefix
                                       in zip(batch.req_rows_cpu, batch.prefix_lens_cpu, strict=True) if prefix])
            self._pre_src = self._pre_src.long()
            self._pre_dst = torch.cat([torch.arange(bases[b], bases[b] + prefix, dtype=torch.int64, device=device)
                                       for b, prefix in enumerate(batch.prefix_lens_cpu) if prefix])
            on_side += [self._pre_src, self._pre_dst]
        self._new_runs = new_runs if len(new_runs) <= self.max_copy_runs else None
        if self._new_runs is None:
            self._new_host = new_host_rows.long()
            on_side.append(self._new_host)
        self._host_kv = host_kv
        L = self.num_layers
        self._ready, self._written, self._staged = [None] * L, [None] * L, [False] * L
        if self.stream is not None:
            current = torch.cuda.current_stream(device)
            self.stream.wait_stream(current)  # index tensors (and the last backup, waited on by `current`)
            for t in on_side:
                t.record_stream(self.stream)
        for layer in range(min(2, L)):
            self._stage(layer)

    def write(self, layer: int, rows: torch.Tensor) -> None:
        """The chunk's new rows [T, row_bytes] of `layer` into their staging rows (compute stream)."""
        if layer >= 2:
            self._wait(self._written[layer - 2])  # the backup of layer − 2 read this buffer's chunk rows
        self.buf[layer % 2].index_copy_(0, self._new_dst, rows)

    def rows(self, layer: int) -> torch.Tensor:
        """The staging buffer of `layer` once its prefix rows have arrived (a GPU-side wait)."""
        if not self._staged[layer]:
            self._stage(layer)
        self._wait(self._ready[layer])
        return self.buf[layer % 2]

    def indices(self, topk_positions: torch.Tensor) -> torch.Tensor:
        """Top-k positions [T, K] (−1 pads) → staging rows of the same tokens, int32."""
        assert self._query_base is not None
        rows = topk_positions.to(torch.int32) + self._query_base
        return torch.where(topk_positions >= 0, rows, torch.full_like(rows, -1))

    def done(self, layer: int) -> None:
        """After `layer`'s attention was queued: its new rows → host pool, then stage layer + 2 into the buffer."""
        stream = self.stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        slot = layer % 2
        with _on(stream):
            if self._new_runs is not None:
                host, staging = self._host_kv[layer], self.buf[slot]
                for src, dst, n in self._new_runs:
                    host[dst : dst + n].copy_(staging[src : src + n], non_blocking=True)
            else:
                kernels.copy_rows(self.buf[slot : slot + 1], self._host_kv[layer : layer + 1], self._new_dst,
                                  self._new_host)
            self._written[layer] = _record(stream)
        if layer + 2 < self.num_layers and not self._staged[layer + 2]:
            self._stage(layer + 2)

    def finish(self) -> torch.cuda.Event | None:
        """End of the forward: the event after the last host write (None on CPU), and the per-forward state
        dropped (the side stream keeps its tensors alive through record_stream)."""
        event = _record(self.stream)
        self._host_kv = None
        self._pre_src = self._pre_dst = self._new_dst = self._new_host = self._query_base = None
        self._prefix_runs = self._new_runs = None
        self._ready, self._written, self._staged = [], [], []
        return event

    # -- internals --
    def _stage(self, layer: int) -> None:
        slot = layer % 2
        with _on(self.stream):
            if self._prefix_runs is not None:
                host, staging = self._host_kv[layer], self.buf[slot]
                for src, dst, n in self._prefix_runs:
                    staging[dst : dst + n].copy_(host[src : src + n], non_blocking=True)
            else:
                kernels.copy_rows(self._host_kv[layer : layer + 1], self.buf[slot : slot + 1], self._pre_src,
                                  self._pre_dst)
            self._ready[layer] = _record(self.stream)
        self._staged[layer] = True

    def _wait(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


def _add_runs(out: list[Run], host_runs: list[tuple[int, int]], staging_start: int, host_to_staging: bool) -> None:
    """Append the runs of one request's rows (host runs in position order, staging rows from `staging_start` on)
    as (source, destination, length), merging a run that continues the previous one in both pools."""
    for host_start, n in host_runs:
        run = (host_start, staging_start, n) if host_to_staging else (staging_start, host_start, n)
        if out and out[-1][0] + out[-1][2] == run[0] and out[-1][1] + out[-1][2] == run[1]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append(run)
        staging_start += n


def _on(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    """`torch.cuda.stream(stream)` for a side stream, nothing for None (CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _record(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event
