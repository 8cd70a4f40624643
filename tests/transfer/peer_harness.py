"""Peer processes for the two-process transfer tests (multiprocessing spawn: a fresh interpreter each, as in
production where prefill and decode are separate servers). Each peer takes commands from a Pipe and answers.

Memory is numpy arrays filled from a seed, so that the parent can recompute what every byte must be.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import traceback
from typing import Any

import numpy as np

CTX = mp.get_context("spawn")


def region_arrays(spec: dict[str, Any], seed: int | None) -> dict[str, np.ndarray]:
    """[layers, rows, row_bytes] uint8 arrays per region: random from `seed`, or zeros when seed is None.

    `spec` = {"num_layers": L, "regions": {name: (num_rows, row_bytes)}}. The arrays are views into one larger
    buffer with a gap between layers, so the layer stride is not rows*row_bytes (as in real strided caches).
    """
    out = {}
    for i, (name, (rows, row_bytes)) in enumerate(sorted(spec["regions"].items())):
        gap = 64 * (i + 1)
        big = np.zeros((spec["num_layers"], rows * row_bytes + gap), dtype=np.uint8)
        if seed is not None:
            big[:] = np.random.default_rng(seed + i).integers(0, 256, size=big.shape, dtype=np.uint8)
        out[name] = big[:, : rows * row_bytes].reshape(spec["num_layers"], rows, row_bytes)
    return out


def run_peer(role: str, conn, spec: dict[str, Any]) -> None:
    """Entry point of a peer process: `role` names a function in this module taking (conn, spec)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(name)s %(levelname)s %(message)s")
    try:
        globals()[role](conn, spec)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        raise


def start_peer(role: str, spec: dict[str, Any]):
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=run_peer, args=(role, child, spec), daemon=True)
    proc.start()
    return proc, parent


def recv(conn, timeout: float = 30.0):
    if not conn.poll(timeout):
        raise TimeoutError("peer process did not answer in time")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(f"peer process failed:\n{msg[1]}")
    return msg


# --- raw transport peers (the mooncake wrapper alone) ----------------------------------------------------------


def raw_receiver(conn, spec) -> None:
    """Registers zeroed destination regions, reports their descriptions, then answers checksum requests."""
    from transfer.mooncake_transport import MooncakeTransport
    from transfer.regions import MemoryRegion

    transport = MooncakeTransport("127.0.0.1", "tcp", transfer_timeout_s=5)
    arrays = region_arrays(spec, seed=None)
    regions = {name: MemoryRegion.from_array(name, a) for name, a in arrays.items()}
    for r in regions.values():
        transport.register(r.base_ptr, r.nbytes)
    conn.send(("ready", transport.session_id, {n: r.describe() for n, r in regions.items()}))
    while True:
        cmd = conn.recv()
        if cmd[0] == "dump":
            conn.send(("dump", {n: a.copy() for n, a in arrays.items()}))
        elif cmd[0] == "close":
            transport.close()
            conn.send(("closed", transport.registered))
            return


def raw_sender(conn, spec) -> None:
    """Writes the coalesced runs of (src_rows -> dst_rows) of every region and layer to the receiver."""
    from transfer.mooncake_transport import MooncakeTransport
    from transfer.regions import MemoryRegion, coalesce_runs, run_entries

    transport = MooncakeTransport("127.0.0.1", "tcp", transfer_timeout_s=5,
                                  max_batch_entries=spec.get("max_batch_entries", 1024))
    arrays = region_arrays(spec, seed=spec["seed"])
    regions = {name: MemoryRegion.from_array(name, a) for name, a in arrays.items()}
    for r in regions.values():
        transport.register(r.base_ptr, r.nbytes)
    conn.send(("ready", transport.session_id))
    while True:
        cmd = conn.recv()
        if cmd[0] == "write":
            _, peer, dst_desc, src_rows, dst_rows = cmd
            runs = coalesce_runs(src_rows, dst_rows)
            srcs, dsts, lens = [], [], []
            for name, src in regions.items():
                s, d, n = run_entries(src, MemoryRegion.from_description(name, dst_desc[name]), runs)
                srcs += s
                dsts += d
                lens += n
            nbytes = transport.batch_write(peer, srcs, dsts, lens)
            conn.send(("written", nbytes, len(srcs)))
        elif cmd[0] == "close":
            transport.close()
            conn.send(("closed", transport.registered))
            return


def pid_of(proc) -> int:
    return proc.pid if proc.pid is not None else os.getpid()
