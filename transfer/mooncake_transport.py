"""The one module that imports mooncake: a thin wrapper over mooncake-transfer-engine's `TransferEngine`.

P2PHANDSHAKE mode (peers exchange segment descriptors directly; no etcd/HTTP metadata server). The engine reads
two process-wide settings from the environment when it is created, so they are set here, before construction:

- `MC_TRANSFER_TIMEOUT` (seconds, the engine clamps it to >= 5): how long a synchronous batch write to a *hung*
  peer may wait (a dead peer fails in under a millisecond: connection refused). Set from our own timeout flag.
- `MC_FORCE_TCP`: the engine auto-discovers RDMA adapters and installs RDMA whenever it finds one, whatever the
  `protocol` argument says; with protocol "tcp" we force TCP so that a TCP deployment stays TCP.

Environment settings are per process: two transports in one process share them (the last one created wins).
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Sequence

from transfer.errors import TransferError

logger = logging.getLogger(__name__)

# One synchronous batch call: the TCP transport rejects very large batches ("TCP lane queue-full"; 4096 entries
# failed in our measurement, 2049 passed). SGLang caps its calls at 1024 entries; so do we by default.
DEFAULT_MAX_BATCH_ENTRIES = 1024
MIN_ENGINE_TIMEOUT_S = 5  # mooncake clamps MC_TRANSFER_TIMEOUT to at least this

_INSTALL_HINT = (
    "install the PD extra: pip install '.[pd]' (CPU machines: mooncake-transfer-engine-non-cuda; CUDA 12: "
    "mooncake-transfer-engine; CUDA 13: mooncake-transfer-engine-cuda13)"
)


# System libraries the mooncake wheels link even for TCP, by the Debian/Ubuntu package that provides each.
_SYSTEM_LIBRARIES = {"libibverbs": "libibverbs1", "libnuma": "libnuma1", "libcurl": "libcurl4",
                     "libmlx5": "ibverbs-providers"}  # fmt: skip


def install_hint(import_error: str) -> str:
    """What to install, from the text of the ImportError that `import mooncake.engine` raised."""
    for library, package in _SYSTEM_LIBRARIES.items():
        if f"{library}." in import_error:
            return (f"the mooncake wheel needs the system library {package} even for TCP: apt-get install "
                    f"{package} (`python -m decode_server.ops check-libs` lists every missing library)")  # fmt: skip
    if "libcudart" in import_error:
        return ("this mooncake wheel is built for another CUDA version; CPU machines take "
                "mooncake-transfer-engine-non-cuda, CUDA 13 hosts mooncake-transfer-engine-cuda13")  # fmt: skip
    return _INSTALL_HINT


def _engine_class():
    """Import mooncake's TransferEngine with an error that says what to install."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ImportError(f"cannot load mooncake transfer engine ({exc}); {install_hint(str(exc))}") from exc
    return TransferEngine


class MooncakeTransport:
    """One transfer engine: registers local memory and writes it into a peer's registered memory.

    `session_id` ("host:rpc_port") is what a peer passes as the target of its writes to us.
    """

    def __init__(
        self,
        hostname: str,
        protocol: str = "tcp",
        ib_device: str | None = None,
        transfer_timeout_s: float = 30.0,
        max_batch_entries: int = DEFAULT_MAX_BATCH_ENTRIES,
    ) -> None:
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {protocol!r}")
        if protocol == "rdma" and not ib_device:
            raise ValueError("protocol 'rdma' needs an RDMA device name (e.g. mlx5_0)")
        if max_batch_entries < 1:
            raise ValueError("max_batch_entries must be >= 1")
        self.hostname = hostname
        self.protocol = protocol
        self.max_batch_entries = max_batch_entries
        self.transfer_timeout_s = max(MIN_ENGINE_TIMEOUT_S, math.ceil(transfer_timeout_s))
        os.environ["MC_TRANSFER_TIMEOUT"] = str(self.transfer_timeout_s)
        if protocol == "tcp":
            os.environ["MC_FORCE_TCP"] = "1"
        elif os.environ.get("MC_FORCE_TCP"):
            logger.warning("MC_FORCE_TCP is set in the environment: mooncake will use TCP although rdma was asked")
        engine = _engine_class()()
        ret = engine.initialize(hostname, "P2PHANDSHAKE", protocol, ib_device or "")
        if ret != 0:
            raise TransferError(
                f"mooncake TransferEngine.initialize({hostname!r}, P2PHANDSHAKE, {protocol!r}, "
                f"{ib_device or ''!r}) returned {ret}"
            )
        self._engine = engine
        self.rpc_port = int(engine.get_rpc_port())
        self.session_id = f"{hostname}:{self.rpc_port}"
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()
        self._closed = False
        logger.info("mooncake transport %s up (protocol %s, transfer timeout %ss)", self.session_id, protocol,
                    self.transfer_timeout_s)

    @property
    def registered(self) -> dict[int, int]:
        """ptr -> nbytes of every buffer registered and not yet unregistered (a leak check for tests)."""
        with self._lock:
            return dict(self._registered)

    def register(self, ptr: int, nbytes: int) -> None:
        """Register [ptr, ptr+nbytes) for transfers; once per buffer (registering twice is an error)."""
        if nbytes <= 0:
            raise ValueError(f"cannot register {nbytes} bytes")
        with self._lock:
            self._check_open()
            if ptr in self._registered:
                raise TransferError(f"buffer 0x{ptr:x} is already registered")
            ret = self._engine.register_memory(ptr, nbytes)
            if ret != 0:
                raise TransferError(f"mooncake register_memory(0x{ptr:x}, {nbytes}) returned {ret}")
            self._registered[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        with self._lock:
            self._check_open()
            if ptr not in self._registered:
                raise TransferError(f"buffer 0x{ptr:x} is not registered")
            ret = self._engine.unregister_memory(ptr)
            del self._registered[ptr]
            if ret != 0:
                raise TransferError(f"mooncake unregister_memory(0x{ptr:x}) returned {ret}")

    def unregister_all(self, ptrs: list[int]) -> None:
        """Unregister each of `ptrs` (then empty the list); a failure is logged, not raised: this runs while an
        owner shuts down or unwinds a failed start, when the remaining buffers must still be released."""
        for ptr in ptrs:
            try:
                self.unregister(ptr)
            except TransferError as exc:
                logger.warning("%s", exc)
        ptrs.clear()

    def batch_write(
        self, peer_session_id: str, src_ptrs: Sequence[int], dst_ptrs: Sequence[int], lengths: Sequence[int]
    ) -> int:
        """Write every (src, dst, length) entry to the peer, in calls of at most `max_batch_entries` entries.

        Blocks until all calls complete; returns the bytes written. Raises TransferError (peer, entries, return
        code) on the first failed call: the destination may then hold a partial write.
        """
        n = len(src_ptrs)
        if len(dst_ptrs) != n or len(lengths) != n:
            raise ValueError("src_ptrs, dst_ptrs and lengths must have the same length")
        engine = self._engine
        if engine is None:
            raise TransferError(f"transport {self.session_id} is closed")
        total = 0
        step = self.max_batch_entries
        for start in range(0, n, step):
            end = min(n, start + step)
            srcs, dsts, lens = list(src_ptrs[start:end]), list(dst_ptrs[start:end]), list(lengths[start:end])
            ret = engine.batch_transfer_sync_write(peer_session_id, srcs, dsts, lens)
            nbytes = sum(lens)
            if ret != 0:
                raise TransferError(
                    f"mooncake batch write to {peer_session_id} failed (return {ret}) on entries "
                    f"{start}..{end - 1} of {n} ({nbytes} bytes): peer dead, unreachable, timed out "
                    f"(> {self.transfer_timeout_s}s) or address not registered there"
                )
            total += nbytes
        return total

    def close(self) -> None:
        """Unregister every buffer still registered and drop the engine (its RPC port closes with it)."""
        with self._lock:
            if self._closed:
                return
            for ptr in list(self._registered):
                ret = self._engine.unregister_memory(ptr)
                if ret != 0:
                    logger.warning("mooncake unregister_memory(0x%x) returned %s at close", ptr, ret)
            self._registered.clear()
            self._closed = True
            self._engine = None

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"transport {self.session_id} is closed")
