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


# --- sender / receiver peers (the full protocol) -----------------------------------------------------------------

LAYOUT_FIELDS = {"model_identity": "test-model", "kv_dtype": "bfloat16", "page_size": 8, "aux_bytes": 24}
AUX_ROWS = 16


def make_layout(spec):
    from transfer.layout import PROTOCOL_VERSION, TransferLayout

    fields = {**LAYOUT_FIELDS, **spec.get("layout_overrides", {})}
    regions = {n: rb for n, (_, rb) in spec["regions"].items()}
    regions.update(spec.get("row_bytes_overrides", {}))
    return TransferLayout(num_layers=spec["num_layers"], regions=regions,
                          protocol_version=spec.get("protocol_version", PROTOCOL_VERSION), **fields)


class PrefillPeer:
    """A prefill process: bootstrap server + KVSender over random source regions."""

    def __init__(self, spec) -> None:
        from transfer.bootstrap import BootstrapServer
        from transfer.mooncake_transport import MooncakeTransport
        from transfer.regions import MemoryRegion
        from transfer.sender import KVSender

        self.bootstrap = BootstrapServer("127.0.0.1", 0)
        self.transport = MooncakeTransport("127.0.0.1", "tcp", transfer_timeout_s=5)
        self.arrays = region_arrays(spec, seed=spec["seed"])
        regions = [MemoryRegion.from_array(n, a) for n, a in self.arrays.items()]
        self.sender = KVSender(self.transport, make_layout(spec), regions, ("127.0.0.1", self.bootstrap.port),
                               "127.0.0.1", bootstrap_timeout_s=spec.get("bootstrap_timeout_s", 30))
        self.events: list = []

    def hello(self):
        return self.bootstrap.port, self.transport.session_id

    def expect(self, room):
        self.sender.expect_room(room)

    def send(self, room, src_rows, token_start):
        self.sender.send_rows(room, src_rows, token_start)

    def finish(self, room, aux):
        self.sender.finish(room, aux)

    def fail(self, room, reason):
        return self.sender.fail(room, reason)

    def release(self, room):
        self.sender.release(room)

    def stop_bootstrap(self):
        self.bootstrap.close()

    def wait_event(self, room, timeout):
        """The next event of `room` (kind, reason, seconds waited), or None after `timeout`."""
        import time

        t0 = time.monotonic()
        while True:
            self.events += self.sender.poll()
            for ev in self.events:
                if ev.room == room:
                    self.events.remove(ev)
                    return ev.kind.value, ev.reason, time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                return None
            time.sleep(0.005)

    def state(self):
        return {"rooms": self.sender.num_rooms_by_state(), "stats": self.sender.stats.snapshot(),
                "registered": len(self.transport.registered)}

    def close(self):
        self.sender.close()
        self.bootstrap.close()
        left = dict(self.transport.registered)
        self.transport.close()
        return left


class DecodePeer:
    """A decode process: KVReceiver over zeroed destination regions and an aux region."""

    def __init__(self, spec) -> None:
        from transfer.mooncake_transport import MooncakeTransport
        from transfer.receiver import KVReceiver, ReceiverTimeouts
        from transfer.regions import MemoryRegion

        self.transport = MooncakeTransport("127.0.0.1", "tcp", transfer_timeout_s=5)
        self.arrays = region_arrays(spec, seed=None)
        layout = make_layout(spec)
        self.aux = np.zeros((1, AUX_ROWS, layout.aux_bytes), dtype=np.uint8)
        regions = [MemoryRegion.from_array(n, a) for n, a in self.arrays.items()]
        self.receiver = KVReceiver(self.transport, layout, regions, MemoryRegion.from_array("aux", self.aux),
                                   ReceiverTimeouts(**spec.get("timeouts", {})), zmq_host="127.0.0.1")
        self.results: list = []

    def hello(self):
        return self.transport.session_id

    def add(self, room, host, port, dst_rows, aux_index):
        self.receiver.add_room(room, host, port, dst_rows, aux_index)

    def abort(self, room):
        self.receiver.abort(room)

    def wait(self, room, timeout):
        """(ok, reason, seconds waited) of `room`, or None after `timeout`."""
        import time

        t0 = time.monotonic()
        while True:
            self.results += self.receiver.poll()
            for res in self.results:
                if res.room == room:
                    self.results.remove(res)
                    return res.ok, res.reason, time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                return None
            time.sleep(0.005)

    def dump(self):
        return {n: a.copy() for n, a in self.arrays.items()}, self.aux[0].copy()

    def state(self):
        return {"rooms": self.receiver.num_rooms_by_state(), "stats": self.receiver.stats.snapshot(),
                "registered": len(self.transport.registered)}

    def close(self):
        self.receiver.close()
        left = dict(self.transport.registered)
        self.transport.close()
        return left


def object_peer(conn, spec) -> None:
    """Runs `spec["class"]` and answers ("ok", result) to every (method, *args) command until "exit"."""
    obj = globals()[spec["class"]](spec)
    conn.send(("ok", obj.hello()))
    while True:
        cmd = conn.recv()
        if cmd[0] == "exit":
            return
        try:
            conn.send(("ok", getattr(obj, cmd[0])(*cmd[1:])))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class Peer:
    """Parent-side handle: `peer.call("method", *args)` runs it in the peer process."""

    def __init__(self, cls: str, spec: dict[str, Any]) -> None:
        self.proc, self.conn = start_peer("object_peer", {**spec, "class": cls})
        self.hello = recv(self.conn, 60)[1]

    def call(self, method: str, *args, timeout: float = 30.0):
        self.conn.send((method, *args))
        return recv(self.conn, timeout)[1]

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def shutdown(self) -> dict:
        """close() in the peer (returns what stayed registered), then exit."""
        left = self.call("close")
        self.conn.send(("exit",))
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        return left
