"""The full protocol between a prefill process (bootstrap server + KVSender) and a decode process (KVReceiver):
real mooncake over TCP on 127.0.0.1, bytes checked, and the non-destructive failure paths (abort, timeouts,
bootstrap unreachable, prefill-side failure). Short timeouts come from constructor arguments."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from free_port_util import free_port
from peer_harness import AUX_ROWS, Peer, region_arrays

SPEC = {
    "num_layers": 3,
    "regions": {"kv": (512, 656), "index_keys": (512, 128), "index_scales": (512, 4)},
    "seed": 99,
    "bootstrap_timeout_s": 1.0,
    "timeouts": {"bootstrap_s": 1.0, "waiting_s": 1.5, "heartbeat_interval_s": 0.2, "heartbeat_max_misses": 2,
                 "abort_ack_timeout_s": 5.0},
}
rooms = itertools.count(1000)


@pytest.fixture(scope="module")
def pair():
    prefill = Peer("PrefillPeer", SPEC)
    decode = Peer("DecodePeer", SPEC)
    try:
        yield prefill, decode
        assert decode.shutdown() == {}, "decode left buffers registered"
        assert prefill.shutdown() == {}, "prefill left buffers registered"
    finally:
        prefill.kill()
        decode.kill()


def paged_rows(rng, n_tokens, page=8, num_pages=64):
    pages = rng.permutation(num_pages)[: (n_tokens + page - 1) // page]
    return [int(p) * page + i for p in pages for i in range(page)][:n_tokens]


def assert_counters(st):
    """Every started room ended exactly once; every failed/aborted room has one cause."""
    finished = st["stats"]["rooms_finished"]
    assert sum(finished.values()) == st["stats"]["rooms_started"], st
    assert sum(st["stats"]["failures"].values()) == finished.get("FAILED", 0) + finished.get("ABORTED", 0), st


def assert_quiet(prefill, decode):
    """No room left in flight on either side, counters consistent."""
    for peer in (prefill, decode):
        st = peer.call("state")
        assert st["rooms"] == {}, st
        assert_counters(st)
        # registered once at start, whole (3 regions + the aux buffer), never per room
        assert st["registered"] == 4, st


def test_chunked_transfer_moves_every_byte(pair):
    prefill, decode = pair
    port, _ = prefill.hello
    rng = np.random.default_rng(3)
    room, n = next(rooms), 200
    # non-contiguous source slots (as a prefill KV pool hands them out) and shuffled destination pages
    others = [int(x) for x in rng.permutation(512) if not 300 <= x < 340][: n - 40]
    src_rows = others[:20] + list(range(300, 340)) + others[20:]
    dst_rows = paged_rows(rng, n)
    decode.call("add", room, "127.0.0.1", port, dst_rows, 5)  # destination may arrive before or after expect
    prefill.call("expect", room)
    assert prefill.call("wait_event", room, 10)[0] == "ready"
    for start in range(0, n, 64):  # chunked prefill: one send per chunk
        prefill.call("send", room, src_rows[start:start + 64], start)
    aux = bytes(range(24))
    prefill.call("finish", room, aux)
    assert prefill.call("wait_event", room, 10)[0] == "success"
    ok, reason, _ = decode.call("wait", room, 10)
    assert ok, reason
    prefill.call("release", room)

    dst, aux_rows = decode.call("dump")
    src = region_arrays(SPEC, seed=SPEC["seed"])
    touched = np.zeros(512, dtype=bool)
    touched[dst_rows] = True
    for name, arr in dst.items():
        np.testing.assert_array_equal(arr[:, dst_rows], src[name][:, src_rows], err_msg=name)
        assert not arr[:, ~touched].any(), f"{name}: untouched rows changed"
    assert bytes(aux_rows[5]) == aux and not np.delete(aux_rows, 5, axis=0).any()
    st = decode.call("state")["stats"]
    assert st["bytes_transferred"] >= n * (656 + 128 + 4) * 3
    assert_quiet(prefill, decode)


def test_rows_per_region_and_destination_before_expect(pair):
    """dst rows may differ per region (e.g. indexer staging elsewhere than the KV pool)."""
    prefill, decode = pair
    port, _ = prefill.hello
    room = next(rooms)
    rows = {"kv": [10, 11, 12, 40], "index_keys": [0, 1, 2, 3], "index_scales": [500, 501, 7, 8]}
    decode.call("add", room, "127.0.0.1", port, rows, 1)
    prefill.call("expect", room)
    prefill.call("send", room, [1, 2, 3, 4], 0)
    prefill.call("finish", room, b"\x07" * 24)
    assert prefill.call("wait_event", room, 10)[0] == "ready"
    assert prefill.call("wait_event", room, 10)[0] == "success"
    assert decode.call("wait", room, 10)[0]
    prefill.call("release", room)
    dst, _ = decode.call("dump")
    src = region_arrays(SPEC, seed=SPEC["seed"])
    for name, r in rows.items():
        np.testing.assert_array_equal(dst[name][:, r], src[name][:, [1, 2, 3, 4]])
    assert_quiet(prefill, decode)


def test_abort_from_decode_reaches_prefill_and_is_acked(pair):
    prefill, decode = pair
    port, _ = prefill.hello
    room = next(rooms)
    acks_before = decode.call("state")["stats"]["abort_acks_received"]
    decode.call("add", room, "127.0.0.1", port, list(range(64)), 2)
    prefill.call("expect", room)
    assert prefill.call("wait_event", room, 10)[0] == "ready"
    prefill.call("send", room, list(range(32)), 0)
    decode.call("abort", room)
    kind, reason, _ = prefill.call("wait_event", room, 5)
    assert kind == "aborted" and "aborted by decode" in reason
    ok, reason, waited = decode.call("wait", room, 5)
    assert not ok and "abort" in reason
    assert decode.call("state")["stats"]["abort_acks_received"] == acks_before + 1
    prefill.call("send", room, list(range(32, 64)), 32)  # late chunks of an aborted room are ignored
    prefill.call("release", room)
    assert_quiet(prefill, decode)


def test_waiting_timeout_aborts_and_frees_prefill(pair):
    prefill, decode = pair
    port, _ = prefill.hello
    room = next(rooms)
    decode.call("add", room, "127.0.0.1", port, list(range(8)), 3)
    prefill.call("expect", room)
    assert prefill.call("wait_event", room, 10)[0] == "ready"
    # prefill never writes: decode's waiting timeout (1.5 s) fails the room and tells prefill
    ok, reason, waited = decode.call("wait", room, 10)
    assert not ok and "waiting timeout" in reason
    assert 1.0 < waited < 5.0
    kind, reason, _ = prefill.call("wait_event", room, 5)
    assert kind == "aborted" and "waiting timeout" in reason
    prefill.call("release", room)
    assert decode.call("state")["stats"]["failures"].get("waiting_timeout") == 1
    assert_quiet(prefill, decode)


def test_bootstrap_unreachable_fails_with_bootstrap_timeout(pair):
    prefill, decode = pair
    room = next(rooms)
    decode.call("add", room, "127.0.0.1", free_port(), list(range(8)), 0)
    ok, reason, waited = decode.call("wait", room, 10)
    assert not ok and "bootstrap timeout" in reason and "unreachable" in reason
    assert waited < 5.0
    # and on prefill: a room whose destination never comes
    room = next(rooms)
    prefill.call("expect", room)
    kind, reason, _ = prefill.call("wait_event", room, 10)
    assert kind == "failed" and "bootstrap timeout" in reason
    prefill.call("release", room)
    assert_quiet(prefill, decode)


def test_prefill_side_failure_aborts_decode_room(pair):
    prefill, decode = pair
    port, _ = prefill.hello
    room = next(rooms)
    decode.call("add", room, "127.0.0.1", port, list(range(16)), 4)
    prefill.call("expect", room)
    assert prefill.call("wait_event", room, 10)[0] == "ready"
    prefill.call("send", room, list(range(8)), 0)
    acks_before = prefill.call("state")["stats"]["abort_acks_received"]
    assert prefill.call("fail", room, "prefill request failed: out of memory")
    ok, reason, _ = decode.call("wait", room, 5)
    assert not ok and "out of memory" in reason
    prefill.call("release", room)
    deadline = time.monotonic() + 5  # decode acknowledges prefill's ABORT too
    while prefill.call("state")["stats"]["abort_acks_received"] == acks_before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert prefill.call("state")["stats"]["abort_acks_received"] == acks_before + 1
    assert_quiet(prefill, decode)


def test_invalid_destination_is_refused(pair):
    """More tokens sent than decode allocated: prefill fails the room and tells decode, nothing out of bounds."""
    prefill, decode = pair
    port, _ = prefill.hello
    room = next(rooms)
    decode.call("add", room, "127.0.0.1", port, list(range(4)), AUX_ROWS - 1)
    prefill.call("expect", room)
    assert prefill.call("wait_event", room, 10)[0] == "ready"
    prefill.call("send", room, list(range(8)), 0)
    kind, reason, _ = prefill.call("wait_event", room, 5)
    assert kind == "failed" and "exceed the 4 rows" in reason
    ok, reason, _ = decode.call("wait", room, 5)
    assert not ok and "more tokens" in reason
    prefill.call("release", room)
    assert_quiet(prefill, decode)


def test_bad_destination_refused_at_add_room(pair):
    prefill, decode = pair
    port, _ = prefill.hello
    with pytest.raises(RuntimeError, match=r"rows \[512\] outside region"):
        decode.call("add", next(rooms), "127.0.0.1", port, [0, 512], 0)
    with pytest.raises(RuntimeError, match="aux index 16 outside"):
        decode.call("add", next(rooms), "127.0.0.1", port, [0, 1], AUX_ROWS)
    with pytest.raises(RuntimeError, match="same number of rows for exactly"):
        decode.call("add", next(rooms), "127.0.0.1", port, {"kv": [0, 1]}, 0)
    assert_quiet(prefill, decode)
