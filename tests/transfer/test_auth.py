"""transfer/auth.py on its own: the secret file, sealed frames, the replay guard, room tickets, and the bootstrap
server and client with and without the secret (no transfer engine needed)."""

from __future__ import annotations

import os
import time

import pytest

from transfer.auth import AuthRejected, PDAuth, ReplayGuard, SecretError, load_secret
from transfer.bootstrap import BootstrapAuthError, BootstrapClient, BootstrapServer
from transfer.channel import ControlChannel
from transfer.messages import Status, decode_envelope

SECRET = os.urandom(32)


def test_secret_file_rules(tmp_path):
    good = tmp_path / "s"
    good.write_text("ab" * 32 + "\n")
    good.chmod(0o600)
    assert load_secret(good) == b"ab" * 32  # the trailing newline does not count
    short = tmp_path / "short"
    short.write_text("x" * 31)
    with pytest.raises(SecretError, match="has 31 bytes; at least 32"):
        load_secret(short)
    with pytest.raises(SecretError, match="cannot read"):
        load_secret(tmp_path / "missing")
    assert PDAuth.from_file(None) is None and PDAuth.from_file(good) is not None


def test_sealed_frames_open_only_with_the_same_secret():
    auth, other = PDAuth(SECRET), PDAuth(os.urandom(32))
    frame = auth.seal(b"payload")
    assert auth.open(frame) == b"payload"
    for bad, reason in ((other.seal(b"payload"), "bad_mac"), (b"payload", "unauthenticated"),
                        (frame[:-1] + b"X", "bad_mac"), (b"HPA1", "unauthenticated")):  # fmt: skip
        with pytest.raises(AuthRejected) as err:
            auth.open(bad)
        assert err.value.reason == reason


def test_replay_guard_refuses_replays_and_stale_timestamps():
    guard = ReplayGuard(window_s=10)
    now = time.time()
    guard.check(now, b"n" * 16, now)
    for ts, nonce, reason in ((now, b"n" * 16, "replay"), (now - 11, b"m" * 16, "stale"),
                              (now + 11, b"o" * 16, "stale"), (now, b"short", "malformed"),
                              ("now", b"p" * 16, "malformed")):  # fmt: skip
        with pytest.raises(AuthRejected) as err:
            guard.check(ts, nonce, now)
        assert err.value.reason == reason
    # a nonce is forgotten once its timestamp has left the window (the timestamp check refuses it from then on)
    guard.check(now + 5, b"q" * 16, now + 5)
    assert len(guard) == 2
    guard.check(now + 12, b"r" * 16, now + 12)  # "n" (valid until now + 10) is forgotten here
    assert len(guard) == 2
    with pytest.raises(AuthRejected) as err:
        guard.check(now, b"n" * 16, now + 12)  # its replay is refused all the same: stale
    assert err.value.reason == "stale"


def test_room_tickets_bind_host_port_and_rooms():
    auth = PDAuth(SECRET)
    ticket = auth.sign_ticket("10.0.0.1", 8998, [2**127 + 1, 5])
    auth.verify_ticket(ticket, "10.0.0.1", 8998, [2**127 + 1, 5])
    for host, port, room in (("10.0.0.2", 8998, [2**127 + 1, 5]), ("10.0.0.1", 8999, [2**127 + 1, 5]),
                             ("10.0.0.1", 8998, [2**127 + 1, 6]), ("10.0.0.1", 8998, 2**127 + 1)):  # fmt: skip
        with pytest.raises(AuthRejected, match="does not match"):
            auth.verify_ticket(ticket, host, port, room)
    with pytest.raises(AuthRejected) as err:
        PDAuth(os.urandom(32)).verify_ticket(ticket, "10.0.0.1", 8998, [2**127 + 1, 5])
    assert err.value.reason == "bad_mac"
    with pytest.raises(AuthRejected) as err:
        auth.verify_ticket(None, "10.0.0.1", 8998, 1)
    assert err.value.reason == "no_ticket"


def test_channel_seals_what_it_sends_and_checks_what_it_gets():
    auth = PDAuth(SECRET)
    a, b = ControlChannel("127.0.0.1", auth), ControlChannel("127.0.0.1", auth)
    rejected: list[str] = []
    c = ControlChannel("127.0.0.1", PDAuth(os.urandom(32)), on_reject=rejected.append)
    try:
        frame = a.frame(b.endpoint, Status(2**100, True))
        msg, reply_to, envelope = decode_envelope(auth.open(frame))
        assert msg == Status(2**100, True) and reply_to == a.endpoint and envelope["to"] == b.endpoint
        a.send(b.endpoint, Status(7, False, "why"))
        a.send(c.endpoint, Status(8, True))  # another secret: dropped and counted there
        got: list = []
        deadline = time.monotonic() + 5
        while (not got or not rejected) and time.monotonic() < deadline:
            got += b.receive(50)
            c.receive(50)
        assert got == [(Status(7, False, "why"), a.endpoint)]
        assert rejected == ["bad_mac"]
        assert not a.send("no endpoint at all", Status(9, True))  # a peer's garbage reply_to: logged, not raised
    finally:
        for ch in (a, b, c):
            ch.close()


def test_bootstrap_server_with_a_secret():
    auth = PDAuth(SECRET)
    server = BootstrapServer("127.0.0.1", 0, auth=auth)
    try:
        info = {"rank": 0, "zmq_endpoint": "tcp://127.0.0.1:1", "session_id": "127.0.0.1:2", "layout": {}}
        client = BootstrapClient("127.0.0.1", server.port, auth=auth)
        client.register(info)
        assert client.lookup(0) == info  # signed request, answer checked
        BootstrapClient("127.0.0.1", server.port).health()  # /health stays open
        with pytest.raises(BootstrapAuthError, match="this server has no secret"):
            BootstrapClient("127.0.0.1", server.port).lookup(0)
        with pytest.raises(BootstrapAuthError, match="ours has another secret"):
            BootstrapClient("127.0.0.1", server.port, auth=PDAuth(os.urandom(32))).lookup(0)
        with pytest.raises(BootstrapAuthError, match="refused our authentication"):
            BootstrapClient("127.0.0.1", server.port).register({**info, "zmq_endpoint": "tcp://evil:1"})
        assert client.lookup(0)["zmq_endpoint"] == "tcp://127.0.0.1:1"  # the unsigned registration changed nothing
        assert server.rejected == {"unauthenticated": 2, "bad_mac": 1}
    finally:
        server.close()
    plain = BootstrapServer("127.0.0.1", 0)  # a prefill without the secret: its answers are not signed
    try:
        BootstrapClient("127.0.0.1", plain.port).register(info)
        with pytest.raises(BootstrapAuthError, match="did not authenticate its answer"):
            BootstrapClient("127.0.0.1", plain.port, auth=auth).lookup(0)
    finally:
        plain.close()
