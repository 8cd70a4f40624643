"""Layout comparison, message codec and the bootstrap server (no transfer engine needed)."""

from __future__ import annotations

import pytest

from transfer.bootstrap import BootstrapClient, BootstrapServer, BootstrapUnavailable
from transfer.layout import PROTOCOL_VERSION, TransferLayout
from transfer.messages import (
    ALL_REGIONS,
    Abort,
    AbortAck,
    ProtocolError,
    Register,
    RegisterReply,
    RoomRequest,
    Status,
    decode,
    encode,
)

LAYOUT = TransferLayout("dsv32:abc", 4, {"kv": 656, "index_keys": 128, "index_scales": 4}, "bfloat16", 64, 32)


def test_layout_mismatch_names_field_and_both_values():
    assert LAYOUT.mismatch(LAYOUT) is None
    cases = {
        "model_identity": ("other", "model identity differs (ours 'dsv32:abc', peer 'other')"),
        "num_layers": (61, "layer count differs (ours 4, peer 61)"),
        "kv_dtype": ("fp8", "KV dtype differs (ours 'bfloat16', peer 'fp8')"),
        "page_size": (1, "page size differs (ours 64, peer 1)"),
        "aux_bytes": (64, "aux record bytes differs (ours 32, peer 64)"),
        "protocol_version": (PROTOCOL_VERSION + 1, f"protocol version differs (ours {PROTOCOL_VERSION}"),
    }
    for field, (value, text) in cases.items():
        other = TransferLayout(**{**LAYOUT.to_dict(), field: value})
        assert text in LAYOUT.mismatch(other), field
    rows = TransferLayout(**{**LAYOUT.to_dict(), "regions": {**LAYOUT.regions, "kv": 1152}})
    assert LAYOUT.mismatch(rows) == "transfer layout mismatch: row bytes of region 'kv' differ (ours 656, peer 1152)"
    names = TransferLayout(**{**LAYOUT.to_dict(), "regions": {"kv": 656}})
    assert "region names differ" in LAYOUT.mismatch(names)
    assert TransferLayout.from_dict(LAYOUT.to_dict()) == LAYOUT
    with pytest.raises(ValueError, match="malformed transfer layout"):
        TransferLayout.from_dict({"num_layers": 4})


def test_messages_round_trip():
    req = RoomRequest(2**62 + 5, "h:1", 3, 7, RoomRequest.pack_rows([5, 6, 700000]))
    msgs = [
        Register("h:1", LAYOUT.to_dict(), {"kv": {"base_ptr": 2**47, "num_layers": 4, "layer_stride_bytes": 10,
                                                  "row_bytes": 656, "num_rows": 9}}, {"base_ptr": 1}),
        RegisterReply("h:1", False, "refused", "p:2"), req, Status(1, True), Status(2, False, "why"),
        Abort(3, "client went away", "h:1"), AbortAck(4),
    ]
    for msg in msgs:
        back, reply_to = decode(encode(msg, "tcp://10.0.0.1:5555"))
        assert back == msg and reply_to == "tcp://10.0.0.1:5555"
    back, _ = decode(encode(req, "x"))
    assert back.rows_for("kv").tolist() == [5, 6, 700000]
    assert list(req.dst_rows) == [ALL_REGIONS]
    per = RoomRequest(1, "h", 2, 0, RoomRequest.pack_rows({"kv": [1, 2], "index_keys": [3, 4]}))
    assert per.rows_for("index_keys").tolist() == [3, 4]
    with pytest.raises(KeyError, match="no destination rows for region 'index_scales'"):
        per.rows_for("index_scales")


def test_garbage_messages_are_protocol_errors():
    import msgpack

    with pytest.raises(ProtocolError, match="undecodable"):
        decode(b"\xc1\xc1")
    with pytest.raises(ProtocolError, match="not a map"):
        decode(msgpack.packb([1, 2]))
    with pytest.raises(ProtocolError, match="malformed control message"):
        decode(msgpack.packb({"v": PROTOCOL_VERSION, "type": "status", "reply_to": "x", "nope": 1}))
    with pytest.raises(ProtocolError, match="malformed control message"):
        decode(msgpack.packb({"v": PROTOCOL_VERSION, "type": "teleport", "reply_to": "x"}))


def test_bootstrap_server_routes_and_health():
    server = BootstrapServer("127.0.0.1", 0)
    try:
        client = BootstrapClient("127.0.0.1", server.port, timeout_s=2)
        with pytest.raises(BootstrapUnavailable, match="answered 503"):
            client.health()
        with pytest.raises(BootstrapUnavailable, match="answered 503.*no prefill rank registered"):
            client.lookup()
        info = {"rank": 0, "zmq_endpoint": "tcp://127.0.0.1:1", "session_id": "127.0.0.1:2",
                "layout": LAYOUT.to_dict()}
        client.register(info)
        client.health()
        assert client.lookup(0) == info
        with pytest.raises(BootstrapUnavailable, match="answered 404.*no prefill rank 3"):
            client.lookup(3)
        with pytest.raises(BootstrapUnavailable, match="answered 400.*missing field 'layout'"):
            client.register({"rank": 1, "zmq_endpoint": "x", "session_id": "y"})
        client.unregister(0)
        with pytest.raises(BootstrapUnavailable, match="503"):
            client.health()
        assert server.bound_address == ("127.0.0.1", server.port)  # binds only the host it was given
    finally:
        server.close()
    with pytest.raises(BootstrapUnavailable, match="unreachable"):
        BootstrapClient("127.0.0.1", server.port, timeout_s=1).health()
