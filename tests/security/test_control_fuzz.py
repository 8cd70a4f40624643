"""Malformed, oversize and random control frames (hypothesis) against the authenticated PD pair: raw bytes, frames
sealed with the right secret around random msgpack maps (an insider's garbage: the decoder's type checks are what
stops it), random bootstrap HTTP requests. Neither server crashes, every refusal is counted, a legitimate request
afterwards gives the reference text, and both servers end with empty pools and the memory they registered at start.
The decoder alone (the path an unauthenticated server exposes to anyone) is fuzzed too: it raises ProtocolError
or returns a well-typed message, nothing else."""

from __future__ import annotations

import socket
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pd_harness import wait_pd_idle
from security_harness import PROMPTS, RawPusher, pd_request

from transfer.auth import NONCE_BYTES, PDAuth
from transfer.channel import MAX_CONTROL_MESSAGE_BYTES
from transfer.layout import PROTOCOL_VERSION
from transfer.messages import MsgType, ProtocolError, ProtocolVersionError, decode_envelope

FIELDS = ["room", "ok", "reason", "receiver_id", "num_tokens", "aux_index", "dst_rows", "layout", "regions", "aux",
          "dest_digest", "sender_id"]  # fmt: skip
scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=24)
           | st.binary(max_size=48))  # fmt: skip
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8), inner, max_size=4), max_leaves=12)
room_bytes = st.binary(min_size=16, max_size=16)
maps = st.fixed_dictionaries(
    {"v": st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, PROTOCOL_VERSION + 1, None, "2"]),
     "type": st.sampled_from([t.value for t in MsgType] + ["teleport", 7]),
     "reply_to": st.sampled_from(["tcp://127.0.0.1:1", "not an endpoint", ""]) | st.text(max_size=30)},
    optional={**{f: values for f in FIELDS}, "room": room_bytes | values,
              "dst_rows": st.dictionaries(st.sampled_from(["*", "kv", "x"]), st.binary(max_size=64), max_size=3)},
)  # fmt: skip


def _sealed(auth: PDAuth, body: dict, endpoint: str, envelope: str) -> bytes:
    if envelope == "valid":
        body = {**body, **PDAuth.envelope(endpoint)}
    elif envelope == "other endpoint":
        body = {**body, **PDAuth.envelope("tcp://127.0.0.1:1")}
    elif envelope == "bad nonce":
        body = {**body, "ts": time.time(), "nonce": b"short", "to": endpoint}
    return auth.seal(msgpack.packb(body, use_bin_type=True))


@given(data=st.binary(max_size=4096) | maps.map(lambda m: msgpack.packb(m, use_bin_type=True)))
@settings(max_examples=600, deadline=None, derandomize=True, database=None)
def test_decoder_returns_a_typed_message_or_a_protocol_error(data):
    try:
        msg, reply_to, envelope = decode_envelope(data)
    except ProtocolVersionError as exc:
        assert isinstance(exc.reply_to, str)
        return
    except ProtocolError:
        return
    assert isinstance(reply_to, str) and isinstance(envelope, dict)
    room = getattr(msg, "room", 0)
    assert isinstance(room, int) and 0 <= room < 2**128
    for name in ("receiver_id", "reason", "sender_id"):
        assert isinstance(getattr(msg, name, ""), str)
    for rows in getattr(msg, "dst_rows", {}).values():
        assert isinstance(rows, bytes) and len(rows) % 4 == 0


def _bootstrap_garbage(port: int, payload: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            sock.recv(4096)
        except OSError:
            pass  # the server may close first: that is a fine answer to garbage


http_garbage = st.one_of(
    st.binary(max_size=512),
    st.builds(lambda method, path, header, body: (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nX-PD-Auth: {header}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode("utf-8", "replace") + body,
        st.sampled_from(["GET", "PUT", "DELETE", "POST", "BREW"]),
        st.sampled_from(["/route", "/route?rank=0", "/route?rank=x", "/health", "/nope"]),
        st.text(alphabet="0123456789abcdef:.", max_size=80), st.binary(max_size=256)),
)  # fmt: skip


@pytest.fixture(scope="module")
def pusher():
    p = RawPusher()
    yield p
    p.close()


def test_random_control_frames_crash_nothing_and_leak_nothing(servers, auth, reference, pusher):
    prefill, decode = servers["prefill"], servers["decode"]
    registered = {s.url: s.stats()["disagg"]["registered_bytes"] for s in (prefill, decode)}
    before = {s.url: sum(s.stats()["disagg"]["rejected_by_reason"].values()) for s in (prefill, decode)}
    targets = [prefill.control_endpoint, decode.control_endpoint]
    sent = {"frames": 0}

    @given(target=st.sampled_from(targets),
           frame=st.one_of(
               st.binary(max_size=2048),
               st.binary(min_size=36, max_size=512).map(lambda b: b"HPA1" + b),
               st.tuples(maps, st.sampled_from(["valid", "valid", "none", "other endpoint", "bad nonce"]))),
           http=http_garbage)  # fmt: skip
    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # fmt: skip
    def attack(target, frame, http):
        if isinstance(frame, tuple):
            frame = _sealed(auth, frame[0], target, frame[1])
        pusher.send(target, frame)
        sent["frames"] += 1
        _bootstrap_garbage(prefill.bootstrap_port, http)

    attack()
    for endpoint in targets:  # one of each kind for sure on both servers, and a frame over the size limit
        for frame in (b"garbage", b"HPA1" + bytes(64), auth.seal(b"\xc1"), b"\0" * (MAX_CONTROL_MESSAGE_BYTES + 1)):
            pusher.send(endpoint, frame)
    # Every frame is accounted for: refused (counted) or taken as an (insider's) message. Then both still serve.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all(s.proc.poll() is None for s in (prefill, decode)) and all(
                s.rejected("oversize") >= 1 for s in (prefill, decode)):  # fmt: skip
            break
        time.sleep(0.2)
    for s in (prefill, decode):
        assert s.proc.poll() is None, s.log_text()[-3000:]
        assert s.rejected("oversize") >= 1
        rejected = s.stats()["disagg"]["rejected_by_reason"]
        assert sum(rejected.values()) > before[s.url], rejected
        assert {"unauthenticated", "bad_mac", "malformed"} <= set(rejected), rejected
    assert prefill.rejected("malformed") + prefill.rejected("unauthenticated") + prefill.rejected("bad_mac") > 0
    for prompt, text in zip(PROMPTS, reference, strict=True):
        status, answer = pd_request(servers, auth, prompt)
        assert status == 200, answer
        assert answer["choices"][0]["text"] == text
    for s in (prefill, decode):
        d = wait_pd_idle(s, 30)
        assert d["registered_bytes"] == registered[s.url]
    assert NONCE_BYTES == 16 and sent["frames"] >= 100
    assert "Traceback" not in prefill.log_text() + decode.log_text()
