"""The node's one host KV buffer under tensor parallelism: a shared-memory region every TP rank maps.

Every rank needs the same MLA rows (the latent row is replicated across ranks), so with `--tp-size N` the host
pool is held once per node instead of once per rank: host memory, not the number of ranks, bounds capacity.

Rank 0 creates a file in /dev/shm of the pool's size (sparse: pages are backed as they are first written) and
broadcasts its path over the gloo `cpu_group`; every rank maps it with `torch.from_file(shared=True)`; after a
barrier (every rank holds its mapping) rank 0 unlinks the file. From then on the memory lives only as long as a
rank maps it: whatever way the ranks end (clean stop, crash, SIGKILL), nothing is left in /dev/shm. On CUDA each
rank registers the mapping with its own GPU (`cudaHostRegister`, portable + mapped) so that its kernels read it
over UVA and its copies are asynchronous, as with the pinned pool of a single rank.

Every rank writes identical bytes to the same rows (its own backup of identical latent rows), so each rank's
HiSparse coordinator behaves as if it owned the pool. Page reuse across ranks is ordered by the engine's
per-step barriers (`Engine.step`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "decode-server-kv-"
# cudaHostRegisterPortable | cudaHostRegisterMapped: pinned for every CUDA context, addressable by kernels.
_CUDA_HOST_REGISTER_FLAGS = 0x01 | 0x02


def shm_free_bytes(directory: Path = SHM_DIR) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _create_region(nbytes: int, directory: Path) -> Path:
    free = shm_free_bytes(directory)
    if nbytes > free:
        raise ValueError(
            f"the shared host KV pool needs {nbytes / 2**30:.2f} GiB in {directory}, which has "
            f"{free / 2**30:.2f} GiB free: lower --host-kv-budget, or enlarge {directory} (docker --shm-size, "
            "a Kubernetes emptyDir with medium: Memory mounted there)"
        )
    path = directory / f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return path


def _register_with_gpu(tensor: torch.Tensor, device: torch.device) -> None:
    cudart = torch.cuda.cudart()
    with torch.cuda.device(device):
        err = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(),
                                      _CUDA_HOST_REGISTER_FLAGS)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of the shared host KV pool failed on {device} (cuda error {int(err)})")
    # Unregister when the last view of the mapping dies (the storage's Python object lives as long as the storage):
    # a registration outlives munmap, so without this the pages would stay pinned and a later pool mapped at the
    # same address (the next engine of a process: benchmarks, tests) could not be registered.
    weakref.finalize(tensor.untyped_storage(), _unregister_from_gpu, tensor.data_ptr(), device)


def _unregister_from_gpu(pointer: int, device: torch.device) -> None:
    try:
        with torch.cuda.device(device):
            err = torch.cuda.cudart().cudaHostUnregister(pointer)
    except Exception:  # noqa: BLE001 - interpreter or CUDA shutting down: the process's exit releases the pages
        return
    if int(err) != 0:
        logger.warning("cudaHostUnregister of the shared host KV pool failed on %s (cuda error %d)", device, int(err))


def allocate_shared_host(shape: tuple[int, ...], parallel: Any, device: torch.device,
                         directory: Path = SHM_DIR) -> torch.Tensor:
    """A uint8 tensor of `shape` backed by one shared-memory region that every rank of `parallel` maps.

    Collective over `parallel.cpu_group`: every rank must call it, in the same order."""
    nbytes = 1
    for n in shape:
        nbytes *= int(n)
    group = parallel.cpu_group
    path: Path | None = None
    try:
        if parallel.tp_rank == 0:
            path = _create_region(nbytes, directory)
            box: list[Any] = [str(path)]
        else:
            box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        name = str(box[0])
        flat = torch.from_file(name, shared=True, size=nbytes, dtype=torch.uint8)
        dist.barrier(group=group)  # every rank holds its mapping: the name is no longer needed
    finally:
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    if device.type == "cuda" and torch.cuda.is_available():
        _register_with_gpu(flat, device)
    logger.info("shared host KV pool: %.1f MiB mapped by tensor-parallel rank %d/%d (%s, unlinked)",
                nbytes / 2**20, parallel.tp_rank, parallel.tp_size, name)  # fmt: skip
    return flat.view(shape)
