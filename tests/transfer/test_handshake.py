"""A mismatched peer is refused on both sides with a message naming the field and both values."""

from __future__ import annotations

import time

import pytest
import zmq
from peer_harness import Peer, make_layout
from test_sender_receiver import SPEC, assert_counters, rooms

from transfer.bootstrap import BootstrapClient
from transfer.channel import ControlChannel
from transfer.layout import PROTOCOL_VERSION
from transfer.messages import Register, RegisterReply, decode, encode


@pytest.fixture(scope="module")
def prefill():
    peer = Peer("PrefillPeer", SPEC)
    try:
        yield peer
        assert peer.shutdown() == {}
    finally:
        peer.kill()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"row_bytes_overrides": {"kv": 600}}, "row bytes of region 'kv' differ (ours 600, peer 656)"),
        ({"layout_overrides": {"page_size": 64}}, "page size differs (ours 64, peer 8)"),
        ({"protocol_version": PROTOCOL_VERSION + 1},
         f"protocol version differs (ours {PROTOCOL_VERSION + 1}, peer {PROTOCOL_VERSION})"),
    ],
)
def test_decode_refuses_mismatched_prefill(prefill, overrides, expected):
    spec = {**SPEC, **overrides}
    if "row_bytes_overrides" in overrides:
        spec["regions"] = {**SPEC["regions"], "kv": (512, 600)}
    decode = Peer("DecodePeer", spec)
    try:
        room = next(rooms)
        decode.call("add", room, "127.0.0.1", prefill.hello[0], list(range(8)), 0)
        ok, reason, waited = decode.call("wait", room, 10)
        assert not ok and "transfer layout mismatch" in reason and expected in reason
        assert waited < 5.0  # refused at lookup: no timeout involved
        st = decode.call("state")
        assert st["stats"]["failures"] == {"handshake": 1}
        assert_counters(st)
        assert decode.shutdown() == {}
    finally:
        decode.kill()


def _register_raw(prefill, layout_dict, version=None) -> RegisterReply:
    """Send a REGISTER straight to prefill's control endpoint (as a buggy or other-version decode would)."""
    info = BootstrapClient("127.0.0.1", prefill.hello[0]).lookup()
    channel = ControlChannel("127.0.0.1")
    try:
        msg = Register("127.0.0.1:1", layout_dict, {}, {"base_ptr": 0, "num_layers": 1, "layer_stride_bytes": 0,
                                                        "row_bytes": 24, "num_rows": 1})
        if version is None:
            channel.send(info["zmq_endpoint"], msg)
        else:
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(info["zmq_endpoint"])
            sock.send(encode(msg, channel.endpoint, version=version))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            for item in channel.receive(100):
                reply, _ = item
                assert isinstance(reply, RegisterReply)
                return reply
        raise AssertionError("prefill did not answer the registration")
    finally:
        channel.close()


def test_prefill_refuses_mismatched_decode(prefill):
    other = make_layout({**SPEC, "num_layers": 4}).to_dict()
    reply = _register_raw(prefill, other)
    assert not reply.ok
    assert reply.reason == "transfer layout mismatch: layer count differs (ours 3, peer 4)"
    dtype = make_layout({**SPEC, "layout_overrides": {"kv_dtype": "fp8_e4m3"}}).to_dict()
    assert "KV dtype differs (ours 'bfloat16', peer 'fp8_e4m3')" in _register_raw(prefill, dtype).reason


def test_prefill_refuses_other_protocol_version(prefill):
    reply = _register_raw(prefill, make_layout(SPEC).to_dict(), version=7)
    assert not reply.ok
    assert f"protocol version 7, ours is {PROTOCOL_VERSION}" in reply.reason


def test_version_mismatch_is_refused_by_the_codec():
    from transfer.messages import ProtocolVersionError

    data = encode(RegisterReply("a", True), "tcp://x:1", version=9)
    with pytest.raises(ProtocolVersionError, match=f"has protocol version 9, ours is {PROTOCOL_VERSION}"):
        decode(data)
