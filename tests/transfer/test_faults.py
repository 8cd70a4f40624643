"""Faults between real processes: a peer killed mid-transfer, heartbeat misses. After each fault no room is left
in flight, the counters add up, and the surviving side unregisters every buffer at close."""

from __future__ import annotations

import pytest
from peer_harness import Peer
from test_sender_receiver import SPEC, assert_counters, rooms


@pytest.fixture
def fresh_pair():
    prefill = Peer("PrefillPeer", SPEC)
    decode = Peer("DecodePeer", SPEC)
    try:
        yield prefill, decode
    finally:
        prefill.kill()
        decode.kill()


def start_room(prefill, decode, n=128):
    port, _ = prefill.hello
    room = next(rooms)
    decode.call("add", room, "127.0.0.1", port, list(range(n)), 0)
    prefill.call("expect", room)
    assert prefill.call("wait_event", room, 10)[0] == "ready"
    return room


def test_prefill_killed_mid_transfer_fails_decode_room_promptly(fresh_pair):
    prefill, decode = fresh_pair
    room = start_room(prefill, decode)
    prefill.call("send", room, list(range(64)), 0)
    prefill.kill()  # SIGKILL: no goodbye message, its bootstrap server dies with it
    ok, reason, waited = decode.call("wait", room, 10)
    assert not ok and "lost connection with prefill" in reason and "heartbeats missed" in reason
    assert waited < 3.0  # heartbeat every 0.2 s, dead after 2 misses
    st = decode.call("state")
    assert st["stats"]["failures"] == {"heartbeat": 1}
    assert_counters(st)
    assert decode.shutdown() == {}


def test_decode_killed_fails_prefill_room_and_frees_it(fresh_pair):
    prefill, decode = fresh_pair
    room, other = start_room(prefill, decode), start_room(prefill, decode)
    prefill.call("send", room, list(range(32)), 0)
    assert prefill.call("state")["rooms"] in ({"TRANSFERRING": 1, "WAITING": 1}, {"WAITING": 2})
    decode.kill()
    prefill.call("send", room, list(range(32, 128)), 32)
    kind, reason, waited = prefill.call("wait_event", room, 10)
    assert kind == "failed" and "KV transfer to decode failed" in reason
    assert waited < 5.0
    # the dead receiver's other room fails fast, without another connection attempt
    prefill.call("send", other, list(range(64)), 0)
    kind, reason, waited = prefill.call("wait_event", other, 10)
    assert kind == "failed" and "failed" in reason and "s ago" in reason
    for r in (room, other):
        prefill.call("release", r)
    st = prefill.call("state")
    assert st["rooms"] == {} and st["stats"]["failures"] == {"transfer": 2}
    assert_counters(st)
    assert prefill.shutdown() == {}


def test_heartbeat_misses_fail_in_flight_rooms_and_tell_prefill(fresh_pair):
    """Prefill lives but its bootstrap server stops answering: decode fails the peer's rooms after N misses and
    still tells prefill (ABORT), which frees them."""
    prefill, decode = fresh_pair
    first, second = start_room(prefill, decode), start_room(prefill, decode)
    prefill.call("stop_bootstrap")
    for room in (first, second):
        ok, reason, _ = decode.call("wait", room, 10)
        assert not ok and "2 heartbeats missed" in reason
        kind, reason, _ = prefill.call("wait_event", room, 5)
        assert kind == "aborted" and "heartbeats missed" in reason
        prefill.call("release", room)
    for peer in (prefill, decode):
        st = peer.call("state")
        assert st["rooms"] == {}
        assert_counters(st)
    assert decode.call("state")["stats"]["failures"] == {"heartbeat": 2}
    assert decode.shutdown() == {}
    assert prefill.shutdown() == {}
