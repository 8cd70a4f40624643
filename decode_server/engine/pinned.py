"""Large page-locked host buffers of exactly the size asked for (the HiSparse host KV pool, PD staging).

Why not `torch.empty(..., pin_memory=True)`: that goes through PyTorch's caching host allocator, which rounds every
request up to the next power of two and keeps freed blocks pinned for reuse. For a pool of tens of GiB this pins
up to twice the memory asked for (a 86 GB pool asked the driver for 128 GiB and failed on the 128 GiB device
machine, 2026-11-26), and a pool freed by one engine stays pinned for the life of the process.

Here each buffer is a memory mapping of its own (whole pages, shared with no other allocation) registered with the
GPU (`cudaHostRegister`, portable + mapped: pinned for every CUDA context and addressable by kernels over UVA, as
cudaHostAlloc memory is). Anonymous mappings are first faulted in by torch's multithreaded fill.

Release is deferred. When a buffer's last view dies (a garbage-collector finalizer, which may run anywhere, also
in the middle of a CUDA graph capture, where cudaHostUnregister is not permitted: it failed with error 900 and
invalidated the capture on the H100, 2026-11-26), the buffer is only queued. `release_unused()` unregisters the
queued buffers and only then lets their mappings go; `host_empty` and the shared pool's allocation call it before
they map more, and callers that free an engine call it when they want the memory back. A registration therefore never outlives its
pages (a later mapping at the same address would fail to register: cuda error 712).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
import weakref
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every CUDA context, addressable by kernels.
CUDA_HOST_REGISTER_FLAGS = 0x01 | 0x02
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712


@dataclass
class _Locked:
    mapping: mmap.mmap
    device: torch.device
    what: str


_LOCKED: dict[int, _Locked] = {}  # live or queued page-locked buffers, by address
_QUEUED: list[int] = []  # addresses whose buffers died, waiting for release_unused()


def lock_mapping(mapping: mmap.mmap, nbytes: int, device: torch.device, what: str,
                 prefault: bool) -> torch.Tensor:
    """A uint8 tensor over the first `nbytes` of `mapping`, page-locked for `device` while it lives (the mapping is
    kept until `release_unused()` has unregistered it; callers run that before mapping more). `prefault`: write
    zeros first, on many threads (only for memory nobody else writes yet: not a shared region other processes may
    already be filling)."""
    flat = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
    if prefault:
        # cudaHostRegister then only locks resident pages, where it would otherwise fault tens of GiB in on one
        # thread (seconds per 10 GiB).
        flat.zero_()
    pointer = flat.data_ptr()
    try:
        _register(pointer, nbytes, device, what)
    except Exception:
        del flat
        with contextlib.suppress(BufferError):
            mapping.close()
        raise
    _LOCKED[pointer] = _Locked(mapping, device, what)
    weakref.finalize(flat.untyped_storage(), _QUEUED.append, pointer)
    logger.debug("%s: %.1f MiB page-locked for %s", what, nbytes / 2**20, device)
    return flat


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, what: str) -> torch.Tensor:
    """A host tensor of `shape`: on a CUDA device page-locked for it (its own anonymous mapping, whole pages,
    zero-filled); uninitialized pageable memory otherwise (CPU engines)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if device.type != "cuda" or not torch.cuda.is_available() or nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    release_unused()  # before mapping more: the memory of buffers that died comes back first
    length = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                        prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return lock_mapping(mapping, nbytes, device, what, prefault=True).view(dtype).view(shape)


def release_unused() -> int:
    """Unregister the buffers whose last view has died, then drop their mappings; returns the bytes released.
    Does nothing while the current stream captures a CUDA graph (they stay queued)."""
    if not _QUEUED or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return 0
    released = 0
    while _QUEUED:
        pointer = _QUEUED.pop()
        locked = _LOCKED.pop(pointer, None)
        if locked is None:
            continue
        _unregister(pointer, locked.device, locked.what)
        released += len(locked.mapping)
        with contextlib.suppress(BufferError):  # still exported: unmapped when the export goes
            locked.mapping.close()
    return released


def locked_bytes() -> int:
    """Bytes of page-locked buffers not yet released (live or queued)."""
    return sum(len(locked.mapping) for locked in _LOCKED.values())


def _register(pointer: int, nbytes: int, device: torch.device, what: str) -> None:
    with torch.cuda.device(device):
        err = int(torch.cuda.cudart().cudaHostRegister(pointer, nbytes, CUDA_HOST_REGISTER_FLAGS))
    if err != 0:
        _clear_last_cuda_error()  # or the next kernel launch check of this process would report it
        cause = ("part of that range is registered already" if err == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
                 else "the host has too little free memory, or the locked-memory limit (ulimit -l, the container's "
                      "memory limit) is lower: lower --host-kv-budget")
        raise RuntimeError(f"could not page-lock {nbytes / 2**30:.2f} GiB of host memory for the {what} on {device} "
                           f"(cuda error {err}): {cause}")


def _unregister(pointer: int, device: torch.device, what: str) -> None:
    with torch.cuda.device(device):
        err = int(torch.cuda.cudart().cudaHostUnregister(pointer))
    if err != 0:
        _clear_last_cuda_error()
        logger.warning("cudaHostUnregister of the %s failed on %s (cuda error %d)", what, device, err)


def _clear_last_cuda_error() -> None:
    """Reset the CUDA runtime's last error (a failed cudaHostRegister sets it; PyTorch's checks after kernel
    launches would raise it later, far from its cause). Through the runtime library PyTorch loaded."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError:
        pass
