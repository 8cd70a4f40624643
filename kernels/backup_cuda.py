"""Eager backup on the GPU: the newest token's rows of every layer, device slots → pinned host rows, in one
kernel launch on a side stream; the caller's stream later waits on the returned event (on the GPU)."""

from __future__ import annotations

import torch

from kernels.cuda_ext import load_extension

_side_streams: dict[int, torch.cuda.Stream] = {}


def _default_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device=index)
    return _side_streams[index]


def backup_rows_cuda(
    device_pool: torch.Tensor,
    host_pool: torch.Tensor,
    src_slots: torch.Tensor,
    dst_rows: torch.Tensor,
    stream: torch.cuda.Stream | None = None,
) -> torch.cuda.Event:
    """device_pool [L, N_dev, B] → host_pool [L, N_host, B] (pinned) at rows dst_rows, from slots src_slots.

    The copy starts after all work already queued on the current stream (it waits on it, on the GPU) and
    runs on `stream`; the returned event completes when the rows are on the host.
    """
    if not host_pool.is_cuda and not host_pool.is_pinned():
        raise ValueError("host_pool must be pinned host memory")
    side = stream if stream is not None else _default_stream(device_pool.device)
    current = torch.cuda.current_stream(device_pool.device)
    src = src_slots.to(device=device_pool.device, dtype=torch.int64).contiguous()
    dst = dst_rows.to(device=device_pool.device, dtype=torch.int64).contiguous()
    side.wait_stream(current)
    ext = load_extension()
    with torch.cuda.stream(side):
        ext.backup(device_pool, host_pool, src, dst)
        # The index tensors were made on `current` and are used on `side`: keep their memory alive.
        src.record_stream(side)
        dst.record_stream(side)
        event = torch.cuda.Event()
        event.record(side)
    return event
