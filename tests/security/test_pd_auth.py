"""The authenticated PD control plane against processes outside the deployment (issue 25).

Real prefill and decode servers holding a cluster secret, real mooncake over TCP on 127.0.0.1. Attackers: a rogue
decode peer with no secret or another one (a real KVReceiver, and hand-made frames), replayed and stale frames,
forged STATUS/ABORT messages to decode for a live room, a completion claimed for other regions, PD requests not
issued by the router, and a decode server of another deployment. In every case the attack is refused and
counted, the legitimate request still produces the reference text, and both servers end with empty pools."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
from pd_harness import wait_for, wait_pd_idle
from security_harness import (
    PROMPTS,
    RawPusher,
    RogueDecode,
    completion_body,
    next_room,
    pd_fields,
    pd_request,
    post_json,
)

from transfer.auth import PDAuth, load_secret
from transfer.channel import ControlChannel
from transfer.messages import Abort, Register, RegisterReply, RoomRequest, Status, encode


def _other(material) -> PDAuth:
    return PDAuth(load_secret(material["other_secret"]))


def _idle(*servers) -> None:
    for s in servers:
        wait_pd_idle(s, 30)


def _reasons(server, *reasons: str) -> dict[str, float]:
    return {r: server.rejected(r) for r in reasons}


def test_servers_report_auth_and_refuse_pd_requests_the_router_did_not_sign(servers, auth, material, reference):
    prefill, decode = servers["prefill"], servers["decode"]
    for s in (prefill, decode):
        assert s.info["disaggregation_auth"] == "on"
        assert s.info["engine"]["disaggregation"]["auth"] == "on"
        assert s.metric("sglang:kv_transfer_auth_enabled") == 1
    room = next_room()
    fields = pd_fields(prefill, room, auth)
    host, port = fields["bootstrap_host"], fields["bootstrap_port"]
    old_ms = int((time.time() - 3600) * 1000)
    tickets = {
        "missing": None,
        "another secret": _other(material).sign_ticket(host, port, room),
        "another room's": auth.sign_ticket(host, port, room + 1),
        "an hour old": f"v1:{old_ms}:{auth._ticket_mac(host, port, room, old_ms)}",
        "garbage": "v1:x:y",
    }
    before = decode.metric("sglang:num_rejected_requests_total", reason="pd_authentication_error")
    for what, ticket in tickets.items():
        body = completion_body(PROMPTS[0], {**fields, "bootstrap_auth": ticket})
        status, answer = post_json(decode, body, 30)
        assert status == 401, (what, answer)
        assert answer["error"]["type"] == "pd_authentication_error", (what, answer)
        assert "router" in answer["error"]["message"]
    after = decode.metric("sglang:num_rejected_requests_total", reason="pd_authentication_error")
    assert after - before == len(tickets)
    # The signed request goes through (and gives the reference text).
    status, answer = pd_request(servers, auth, PROMPTS[0])
    assert status == 200 and answer["choices"][0]["text"] == reference[0]
    _idle(prefill, decode)


def test_rogue_decode_peer_gets_nothing_and_the_request_completes(servers, auth, material, reference):
    """A process that reaches prefill's ports asks for a request's room (the KV of someone else's prompt) with no
    secret or with another one: through the real protocol (KVReceiver) and with hand-made REGISTER/ROOM frames.
    Its memory stays zero, prefill counts every refusal, and the real request completes with the right text."""
    prefill, decode = servers["prefill"], servers["decode"]
    prompt = PROMPTS[1]
    room = next_room()
    body = completion_body(prompt, pd_fields(prefill, room, auth))
    before = _reasons(prefill, "unauthenticated", "bad_mac")
    layout = decode.info["engine"]["disaggregation"]["layout"]
    rogues: list[RogueDecode] = []
    pusher = RawPusher()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        prefill_answer = pool.submit(post_json, prefill, body, 120)
        try:
            # The victim's prompt waits on prefill for its destination: the moment a thief would strike.
            wait_for(lambda: prefill.stats()["disagg"]["num_bootstrapping_reqs"] == 1, 30, "prefill to park it")
            rogues = [RogueDecode(layout, None), RogueDecode(layout, _other(material))]
            for rogue, expected in zip(rogues, ("this server has no secret", "ours has another secret"), strict=True):
                rogue.receiver.add_room(room, "127.0.0.1", prefill.bootstrap_port, list(range(len(prompt))), 0)
                result = rogue.wait(room)
                assert not result.ok and "authentication with prefill failed" in result.reason, result
                assert expected in result.reason, result
                assert rogue.receiver.stats.snapshot()["failures"] == {"auth": 1}
            # By hand, straight to prefill's control endpoint (reachable: any process can connect to it).
            rogue = rogues[0]
            regions, aux = rogue.regions_description()
            frames_of = [Register(rogue.transport.session_id, rogue.layout.to_dict(), regions, aux),
                         RoomRequest(room, rogue.transport.session_id, len(prompt), 0,
                                     RoomRequest.pack_rows(list(range(len(prompt)))))]  # fmt: skip
            endpoint, other = prefill.control_endpoint, _other(material)
            for msg in frames_of:
                pusher.send(endpoint, encode(msg, rogue.receiver.endpoint))
                pusher.send(endpoint, other.seal(encode(msg, rogue.receiver.endpoint,
                                                        envelope=PDAuth.envelope(endpoint))))  # fmt: skip
            wait_for(lambda: prefill.rejected("unauthenticated") >= before["unauthenticated"] + 3
                     and prefill.rejected("bad_mac") >= before["bad_mac"] + 3, 20, "prefill's refusals")  # fmt: skip
            assert not prefill_answer.done()  # the victim's request is still waiting for its real decode server
            status, answer = pool.submit(post_json, decode, body, 120).result()
            assert status == 200, answer
            assert answer["choices"][0]["text"] == reference[1]
            assert prefill_answer.result()[0] == 200
            time.sleep(0.5)  # anything misdirected would have landed by now
            for rogue in rogues:
                assert rogue.untouched(), "KV reached a peer outside the deployment"
        finally:
            pusher.close()
            for rogue in rogues:
                rogue.close()
    _idle(prefill, decode)


def _fake_regions(layout: dict, rows: int = 16) -> tuple[dict, dict]:
    regions = {name: {"base_ptr": 1 << 20, "num_layers": layout["num_layers"],
                      "layer_stride_bytes": rows * rb, "row_bytes": rb, "num_rows": rows}
               for name, rb in layout["regions"].items()}  # fmt: skip
    aux = {"base_ptr": 1 << 21, "num_layers": 1, "layer_stride_bytes": 0, "row_bytes": layout["aux_bytes"],
           "num_rows": 4}
    return regions, aux


def _replies(channel: ControlChannel, seconds: float) -> list:
    out, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        out += [m for m, _ in channel.receive(50)]
    return out


def test_replayed_stale_and_misaddressed_registrations_are_rejected(servers, auth):
    """A valid registration (made with the secret, as a captured one would be) is accepted once; the same bytes
    again are a replay; a frame made two windows ago is stale; one addressed to another endpoint is refused."""
    prefill = servers["prefill"]
    layout = prefill.info["engine"]["disaggregation"]["layout"]
    endpoint = prefill.control_endpoint
    regions, aux = _fake_regions(layout)
    before = _reasons(prefill, "replay", "stale", "wrong_destination")
    channel = ControlChannel("127.0.0.1", auth)  # where prefill answers (and answers are checked)
    pusher = RawPusher()
    try:
        frame = channel.frame(endpoint, Register("127.0.0.1:9", layout, regions, aux))
        pusher.send(endpoint, frame)
        replies = _replies(channel, 2.0)
        assert len(replies) == 1 and isinstance(replies[0], RegisterReply) and replies[0].ok, replies
        pusher.send(endpoint, frame)  # the captured frame, replayed
        stale = encode(Register("127.0.0.1:10", layout, regions, aux), channel.endpoint,
                       envelope={**PDAuth.envelope(endpoint), "ts": time.time() - 2 * auth.window_s})  # fmt: skip
        pusher.send(endpoint, auth.seal(stale))
        pusher.send(endpoint, channel.frame("tcp://127.0.0.1:1", Register("127.0.0.1:11", layout, regions, aux)))
        wait_for(lambda: all(prefill.rejected(r) == before[r] + 1 for r in before), 20, "the three refusals")
        assert _replies(channel, 0.5) == []  # none of them was answered
        assert channel.auth is not None
    finally:
        pusher.close()
        channel.close()


def test_forged_status_and_abort_to_decode_are_rejected(servers, auth, material, reference):
    """While a room waits for its KV, STATUS ok / ABORT for it arrive from outside (no secret, another secret) and
    from a member of the deployment that is not the room's prefill: all refused, the request finishes right."""
    prefill, decode = servers["prefill"], servers["decode"]
    room = next_room()
    body = completion_body(PROMPTS[0], pd_fields(prefill, room, auth))
    before = _reasons(decode, "unauthenticated", "bad_mac", "wrong_peer")
    pusher = RawPusher()
    member = ControlChannel("127.0.0.1", auth)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        decode_answer = pool.submit(post_json, decode, body, 120)
        try:
            wait_for(lambda: decode.stats()["disagg"]["rooms_by_state"].get("WAITING") == 1, 30,
                     "decode to send the destination")  # fmt: skip
            endpoint = decode.control_endpoint
            for msg in (Status(room, True), Abort(room, "forged abort")):
                pusher.send(endpoint, encode(msg, prefill.control_endpoint))
                pusher.send(endpoint, _other(material).seal(
                    encode(msg, prefill.control_endpoint, envelope=PDAuth.envelope(endpoint))))
                member.send(endpoint, msg)  # authentic, but not from the room's prefill
            wait_for(lambda: all(decode.rejected(r) >= before[r] + 2 for r in before), 20, "decode's refusals")
            assert not decode_answer.done()
            assert decode.stats()["disagg"]["rooms_by_state"].get("WAITING") == 1
            assert pool.submit(post_json, prefill, body, 120).result()[0] == 200
            status, answer = decode_answer.result()
            assert status == 200, answer
            assert answer["choices"][0]["text"] == reference[0]
        finally:
            pusher.close()
            member.close()
    _idle(prefill, decode)


def test_completion_claimed_for_other_regions_fails_the_room_cleanly(servers, auth):
    """An authentic STATUS ok from the room's prefill endpoint that names another destination than the one decode
    registered: decode does not take the pages as filled; the request fails with a clear error, nothing leaks."""
    prefill, decode = servers["prefill"], servers["decode"]
    room = next_room()
    body = completion_body(PROMPTS[0], pd_fields(prefill, room, auth))
    before = decode.rejected("wrong_destination")
    pusher = RawPusher()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        decode_answer = pool.submit(post_json, decode, body, 120)
        try:
            wait_for(lambda: decode.stats()["disagg"]["rooms_by_state"].get("WAITING") == 1, 30, "the destination")
            endpoint = decode.control_endpoint
            frame = auth.seal(encode(Status(room, True, dest_digest=bytes(32)), prefill.control_endpoint,
                                     envelope=PDAuth.envelope(endpoint)))  # fmt: skip
            pusher.send(endpoint, frame)
            status, answer = decode_answer.result()
        finally:
            pusher.close()
    assert status == 503, answer
    assert answer["error"]["type"] == "kv_transfer_failed"
    assert "destination other than the one" in answer["error"]["message"]
    assert decode.rejected("wrong_destination") == before + 1
    _idle(prefill, decode)


def test_mismatched_secrets_fail_fast_with_a_clear_error(servers, auth, material):
    """A decode server of another deployment (another secret) paired with our prefill: decode's request fails
    within seconds naming the secrets (not after its waiting timeout); prefill's ends at its bootstrap timeout
    (a router aborts it at once when decode fails); both sides end empty."""
    prefill, stranger = servers["prefill"], servers["stranger"]
    room = next_room()
    before = prefill.rejected("bad_mac")
    prefill_body = completion_body(PROMPTS[0], pd_fields(prefill, room, auth))
    stranger_body = completion_body(PROMPTS[0], pd_fields(prefill, room, _other(material)))
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(post_json, prefill, prefill_body, 60)
        d = pool.submit(post_json, stranger, stranger_body, 60)
        status, answer = d.result()
        decode_s = time.monotonic() - t0
        p_status, p_answer = p.result()
    assert status == 503, answer
    message = answer["error"]["message"]
    assert "authentication with prefill failed" in message and "--disaggregation-auth-secret-file" in message
    assert decode_s < 10, decode_s  # the waiting timeout is 60 s: this is the fast path
    assert p_status == 503 and "bootstrap timeout" in p_answer["error"]["message"], p_answer
    assert prefill.rejected("bad_mac") >= before + 1
    assert stranger.stats()["disagg"]["failures_by_cause"].get("auth", 0) >= 1
    _idle(prefill, stranger)


@pytest.mark.parametrize("path", ["/route?rank=0", "/route"])
def test_bootstrap_routes_need_the_secret(servers, material, path):
    """The bootstrap server gives nothing (not even prefill's control endpoint) without the secret."""
    import httpx

    prefill = servers["prefill"]
    url = f"http://127.0.0.1:{prefill.bootstrap_port}{path}"
    before = prefill.rejected("unauthenticated")
    r = httpx.get(url, timeout=5) if "?" in path else httpx.put(url, json={"rank": 0}, timeout=5)
    assert r.status_code == 401 and "zmq_endpoint" not in r.text
    assert prefill.rejected("unauthenticated") == before + 1
    assert httpx.get(f"http://127.0.0.1:{prefill.bootstrap_port}/health", timeout=5).status_code == 200
