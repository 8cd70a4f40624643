"""Host buffers page-locked at exactly their size (decode_server/engine/pinned.py), on CUDA.

The bug this guards against (device machine, 2026-11-26): the host KV pool came from PyTorch's caching host
allocator, which rounds to the next power of two, so an 86 GB pool asked the driver for 128 GiB and failed, and a
freed pool stayed pinned for the rest of the process."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from decode_server.engine import pinned
from decode_server.engine.pinned import host_empty


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


@pytest.fixture
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.gpu
def test_exact_size_locked_readable_by_the_gpu_and_released(cuda):
    """5 GiB + 1 MiB: pinned (is_pinned, asynchronous copies work; the swap-in kernel's reads over UVA are
    exercised by every HiSparse GPU test), locked at its page-rounded size (the caching host allocator would have
    taken 8 GiB), released with its last view, and registered again at once after being freed."""
    nbytes = (5 << 30) + (1 << 20)
    if _mem_available() < 3 * nbytes:
        pytest.skip("not enough host memory")
    for round_ in range(2):
        buf = host_empty((nbytes,), torch.uint8, cuda, "test buffer")
        assert buf.is_pinned() and buf.numel() == nbytes
        assert pinned.locked_bytes() == -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE  # not 8 GiB
        tail = buf[-(64 << 20):]
        tail.copy_(torch.arange(tail.numel(), dtype=torch.int64).to(torch.uint8))
        on_gpu = tail.to(cuda, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(on_gpu.cpu(), tail), round_
        del buf, tail
        gc.collect()
        assert pinned.release_unused() >= nbytes and pinned.locked_bytes() == 0, round_


@pytest.mark.gpu
def test_a_buffer_dying_during_graph_capture_does_not_break_it(cuda):
    """The H100 failure of 2026-11-26: a host pool's last view died while a CUDA graph was being captured (the
    garbage collector ran there); unregistering it then failed (error 900) and invalidated the capture. Now the
    capture completes and replays, and the buffer is released after it."""
    buf = host_empty((64 << 20,), torch.uint8, cuda, "test buffer")
    x = torch.ones(1024, device=cuda)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2
        del buf
        gc.collect()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, 2.0))
    assert pinned.release_unused() >= 64 << 20 and pinned.locked_bytes() == 0


def test_cpu_device_gives_pageable_memory():
    buf = host_empty((3, 5), torch.float32, torch.device("cpu"), "test buffer")
    assert buf.shape == (3, 5) and buf.dtype == torch.float32 and buf.device.type == "cpu"
    assert pinned.locked_bytes() == 0


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


def test_release_is_deferred_and_unregisters_before_unmapping(monkeypatch):
    """The CUDA path's bookkeeping, with the two CUDA calls recorded instead of made (CPU): each buffer is a
    mapping of its own (page-aligned), zero-filled, registered once for its exact size. When its last view dies
    nothing touches CUDA (a finalizer may run inside a CUDA graph capture, where cudaHostUnregister fails and
    breaks the capture: H100, 2026-11-26); the buffer stays mapped and registered until `release_unused()` (or the
    next `host_empty`), which unregisters it while its pages are still mapped and only then unmaps them (a
    registration that outlives its pages makes a later buffer at that address unregistrable: cuda error 712)."""
    calls = []
    monkeypatch.setattr(pinned.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinned.torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(pinned, "_register", lambda ptr, n, dev, what: calls.append(("register", ptr, n)))
    monkeypatch.setattr(pinned, "_unregister", lambda ptr, dev, what: calls.append(("unregister", ptr, _mapped(ptr))))
    cuda = torch.device("cuda")
    for dtype, shape in [(torch.uint8, (3, 4097, 5)), (torch.float32, (7, 1000)), (torch.float8_e4m3fn, (2, 9))]:
        calls.clear()
        buf = host_empty(shape, dtype, cuda, "test buffer")
        pointer = buf.data_ptr()
        nbytes = buf.numel() * buf.element_size()
        pages = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        assert buf.shape == shape and buf.dtype == dtype and pointer % mmap.PAGESIZE == 0
        assert torch.count_nonzero(buf.view(torch.uint8)) == 0
        assert calls == [("register", pointer, nbytes)] and pinned.locked_bytes() == pages
        view = buf[1:]
        del buf
        gc.collect()
        assert pinned.release_unused() == 0 and len(calls) == 1  # a view still holds the storage
        del view
        gc.collect()
        assert len(calls) == 1 and _mapped(pointer) and pinned.locked_bytes() == pages  # queued only
        assert pinned.release_unused() == pages
        assert calls == [("register", pointer, nbytes), ("unregister", pointer, True)]
        assert pinned.locked_bytes() == 0 and not _mapped(pointer)
    # The next host_empty releases what died before it maps more.
    calls.clear()
    first = host_empty((100,), torch.uint8, cuda, "test buffer")
    first_pointer = first.data_ptr()
    del first
    gc.collect()
    second = host_empty((100,), torch.uint8, cuda, "test buffer")
    assert calls[:2] == [("register", first_pointer, 100), ("unregister", first_pointer, True)]
    assert pinned.locked_bytes() == mmap.PAGESIZE
    del second
    gc.collect()
    pinned.release_unused()


def test_nothing_is_released_while_a_graph_is_captured(monkeypatch):
    calls = []
    monkeypatch.setattr(pinned.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pinned, "_register", lambda ptr, n, dev, what: None)
    monkeypatch.setattr(pinned, "_unregister", lambda ptr, dev, what: calls.append(ptr))
    buf = host_empty((100,), torch.uint8, torch.device("cuda"), "test buffer")
    del buf
    gc.collect()
    monkeypatch.setattr(pinned.torch.cuda, "is_current_stream_capturing", lambda: True)
    assert pinned.release_unused() == 0 and calls == [] and pinned.locked_bytes() == mmap.PAGESIZE
    monkeypatch.setattr(pinned.torch.cuda, "is_current_stream_capturing", lambda: False)
    assert pinned.release_unused() == mmap.PAGESIZE and len(calls) == 1
