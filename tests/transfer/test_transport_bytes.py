"""Real mooncake over TCP between two processes: every destination byte is checked, untouched rows stay zero."""

from __future__ import annotations

import os

import numpy as np
import pytest
from peer_harness import recv, region_arrays, start_peer

SPEC = {
    "num_layers": 3,
    # three regions of different row bytes (MLA row, indexer keys, indexer scales)
    "regions": {"kv": (300, 656), "index_keys": (300, 128), "index_scales": (300, 4)},
    "seed": 1234,
    "max_batch_entries": 7,  # small cap: the write must be split into several engine calls
}


@pytest.fixture(scope="module")
def peers():
    recv_proc, recv_conn = start_peer("raw_receiver", SPEC)
    send_proc, send_conn = start_peer("raw_sender", SPEC)
    try:
        _, recv_session, dst_desc = recv(recv_conn)
        _, send_session = recv(send_conn)
        yield recv_conn, send_conn, recv_session, dst_desc
        for conn in (send_conn, recv_conn):
            conn.send(("close",))
            _, still_registered = recv(conn)
            assert still_registered == {}
    finally:
        for proc in (recv_proc, send_proc):
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def test_two_process_write_moves_every_byte(peers):
    recv_conn, send_conn, recv_session, dst_desc = peers
    rng = np.random.default_rng(7)
    # 150 tokens: source slots in a few contiguous stretches, destination rows in shuffled pages of 8 rows
    src_rows = list(range(10, 60)) + list(range(100, 150)) + list(range(200, 250))
    pages = rng.permutation(np.arange(36))[:19]
    dst_rows = [int(p) * 8 + i for p in pages for i in range(8)][:150]
    send_conn.send(("write", recv_session, dst_desc, src_rows, dst_rows))
    _, nbytes, entries = recv(send_conn)
    assert nbytes == 150 * (656 + 128 + 4) * SPEC["num_layers"]
    assert entries < 150 * 3 * SPEC["num_layers"]  # coalescing merged rows into runs

    recv_conn.send(("dump",))
    _, dst = recv(recv_conn)
    src = region_arrays(SPEC, seed=SPEC["seed"])
    written = np.zeros(300, dtype=bool)
    written[dst_rows] = True
    for name, arr in dst.items():
        np.testing.assert_array_equal(arr[:, dst_rows], src[name][:, src_rows], err_msg=name)
        assert not arr[:, ~written].any(), f"{name}: rows that were not targets changed"


def test_transport_settings_and_registration(monkeypatch):
    """Our timeout flag becomes mooncake's MC_TRANSFER_TIMEOUT (clamped to its 5 s minimum) before the engine
    exists; tcp forces TCP; buffers register once and close() unregisters what is left."""
    from transfer.errors import TransferError
    from transfer.mooncake_transport import MooncakeTransport

    monkeypatch.delenv("MC_TRANSFER_TIMEOUT", raising=False)
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    with pytest.raises(ValueError, match="needs an RDMA device"):
        MooncakeTransport("127.0.0.1", "rdma")
    with pytest.raises(ValueError, match="protocol must be"):
        MooncakeTransport("127.0.0.1", "udp")
    t = MooncakeTransport("127.0.0.1", "tcp", transfer_timeout_s=2.5)
    assert os.environ["MC_TRANSFER_TIMEOUT"] == "5" and os.environ["MC_FORCE_TCP"] == "1"
    assert t.session_id == f"127.0.0.1:{t.rpc_port}"
    a, b = np.zeros(4096, np.uint8), np.zeros(64, np.uint8)
    t.register(a.ctypes.data, a.nbytes)
    t.register(b.ctypes.data, b.nbytes)
    with pytest.raises(TransferError, match="already registered"):
        t.register(a.ctypes.data, a.nbytes)
    t.unregister(b.ctypes.data)
    assert t.registered == {a.ctypes.data: 4096}
    with pytest.raises(TransferError, match="failed"):  # nobody listens there: fails at once, not after 5 s
        t.batch_write("127.0.0.1:1", [a.ctypes.data], [0], [16])
    t.close()
    assert t.registered == {}
    with pytest.raises(TransferError, match="closed"):
        t.batch_write("127.0.0.1:1", [a.ctypes.data], [0], [16])
