"""The node's one host KV buffer under tensor parallelism: a shared-memory region every TP rank maps.

Every rank needs the same MLA rows (the latent row is replicated across ranks), so with `--tp-size N` the host
pool is held once per node instead of once per rank: host memory, not the number of ranks, bounds capacity.

Rank 0 creates a file in /dev/shm of the pool's size (sparse: pages are backed as they are first written) and
broadcasts its path over the gloo `cpu_group`; every rank maps it (`mmap`, shared); after a
barrier (every rank holds its mapping) rank 0 unlinks the file. From then on the memory lives only as long as a
rank maps it: whatever way the ranks end (clean stop, crash, SIGKILL), nothing is left in /dev/shm. On CUDA each
rank registers the mapping with its own GPU (`cudaHostRegister`, portable + mapped, through
decode_server/engine/pinned.py, which also unregisters it before it is unmapped) so that its kernels read it
over UVA and its copies are asynchronous, as with the pinned pool of a single rank.

Every rank writes identical bytes to the same rows (its own backup of identical latent rows), so each rank's
HiSparse coordinator behaves as if it owned the pool. Page reuse across ranks is ordered by the engine's
per-step barriers (`Engine.step`).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from decode_server.engine.pinned import lock_mapping, release_unused

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "decode-server-kv-"


def shm_free_bytes(directory: Path = SHM_DIR) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _create_region(nbytes: int, directory: Path, what: str) -> Path:
    free = shm_free_bytes(directory)
    if nbytes > free:
        raise ValueError(
            f"the {what} needs {nbytes / 2**30:.2f} GiB in {directory}, which has "
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


def allocate_shared_host(shape: tuple[int, ...], parallel: Any, device: torch.device,
                         directory: Path = SHM_DIR, what: str = "shared host KV pool") -> torch.Tensor:
    """A uint8 tensor of `shape` backed by one shared-memory region that every rank of `parallel` maps.

    Collective over `parallel.cpu_group`: every rank must call it, in the same order. `what` names the region in
    errors and logs (the KV pool; a PD decode server's staging areas use it too)."""
    nbytes = 1
    for n in shape:
        nbytes *= int(n)
    group = parallel.cpu_group
    path: Path | None = None
    try:
        if parallel.tp_rank == 0:
            path = _create_region(nbytes, directory, what)
            box: list[Any] = [str(path)]
        else:
            box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        name = str(box[0])
        if device.type == "cuda" and torch.cuda.is_available():
            release_unused()  # dead pools' pages go before more are mapped
        fd = os.open(name, os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the region
        dist.barrier(group=group)  # every rank holds its mapping: the name is no longer needed
    finally:
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    if device.type == "cuda" and torch.cuda.is_available():
        # Not prefaulted: other ranks may be writing rows already.
        flat = lock_mapping(mapping, nbytes, device, what, prefault=False)
    else:
        flat = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
    logger.info("%s: %.1f MiB mapped by tensor-parallel rank %d/%d (%s, unlinked)",
                what, nbytes / 2**20, parallel.tp_rank, parallel.tp_size, name)  # fmt: skip
    return flat.view(shape)
