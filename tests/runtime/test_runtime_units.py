"""Unit tests of the engine-process runtime without a server: the api <-> engine message codec and the engine loop
over ZMQ (decode_server/runtime/)."""

from __future__ import annotations

import threading
import uuid

import pytest
import zmq

from decode_server.engine.sampling_params import SamplingParams
from decode_server.engine.types import EngineStats, RequestDelta
from decode_server.errors import ContextLengthExceededError, QueueFullError, ServerShuttingDownError
from decode_server.runtime.loop import EngineLoop
from decode_server.runtime.messages import (
    AbortMsg,
    AcceptedMsg,
    DeltasMsg,
    GenerateMsg,
    RejectedMsg,
    ShutdownMsg,
    StatsMsg,
    StatsQueryMsg,
    decode_from_engine,
    decode_to_engine,
    encode,
)

# ------------------------------------------------------------------------------------------------ messages


def test_codec_round_trip_and_direction_check() -> None:
    msg = GenerateMsg("r1", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0, stop=["x"]))
    back = decode_to_engine(encode(msg))
    assert back == msg and back.params.stop == ["x"]
    deltas = DeltasMsg(
        [RequestDelta(rid="r1", new_token_ids=[7], text="a", finished=True, finish_reason="length")]
    )
    assert decode_from_engine(encode(deltas)) == deltas
    with pytest.raises(TypeError):
        decode_to_engine(encode(deltas))  # an engine→api message is refused by the engine
    with pytest.raises(TypeError):
        decode_from_engine(encode(AbortMsg("r1")))
    with pytest.raises(TypeError):
        encode({"not": "a message"})  # type: ignore[arg-type]


def test_rejection_keeps_error_class_message_and_param() -> None:
    exc = ContextLengthExceededError("too long", param="max_tokens")
    rebuilt = decode_from_engine(encode(RejectedMsg.from_exception("r", exc))).to_exception()
    assert type(rebuilt) is ContextLengthExceededError
    assert rebuilt.status_code == 400 and rebuilt.message == "too long" and rebuilt.param == "max_tokens"
    assert type(RejectedMsg.from_exception("r", QueueFullError("full")).to_exception()) is QueueFullError
    assert RejectedMsg.from_exception("r", ServerShuttingDownError("x")).to_exception().status_code == 503
    generic = RejectedMsg.from_exception("r", RuntimeError("boom")).to_exception()
    assert generic.status_code == 500 and "boom" in generic.message


class _ScriptedEngine:
    """The Engine API in miniature: each request emits `max_tokens` tokens, one per step."""

    def __init__(self) -> None:
        self.reqs: dict[str, list[int]] = {}
        self.aborted: list[str] = []

    def add_request(self, rid: str, ids: list[int], params: SamplingParams) -> None:
        if len(ids) > 5:
            raise ContextLengthExceededError("prompt beyond 5 tokens", param="prompt")
        self.reqs[rid] = [params.max_tokens, 0]

    def abort_request(self, rid: str) -> None:
        self.reqs.pop(rid, None)
        self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def step(self) -> list[RequestDelta]:
        out = []
        for rid, state in list(self.reqs.items()):
            state[1] += 1
            done = state[1] == state[0]
            out.append(RequestDelta(rid=rid, new_token_ids=[state[1]], finished=done,
                                    finish_reason="length" if done else None))  # fmt: skip
            if done:
                del self.reqs[rid]
        return out

    def stats(self) -> EngineStats:
        return EngineStats(num_running_reqs=len(self.reqs))


def test_engine_loop_acknowledges_before_deltas_and_aborts_on_shutdown() -> None:
    ctx = zmq.Context()
    name = uuid.uuid4().hex
    api_push, engine_pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    engine_push, api_pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    api_push.bind(f"inproc://{name}-in")
    engine_pull.connect(f"inproc://{name}-in")
    api_pull.bind(f"inproc://{name}-out")
    engine_push.connect(f"inproc://{name}-out")
    engine = _ScriptedEngine()
    loop = EngineLoop(engine, engine_pull, engine_push, parent_pid=None)
    thread = threading.Thread(target=loop.run, daemon=True)  # each socket is used by one thread only
    try:
        greedy = SamplingParams(max_tokens=3, temperature=0.0)
        for msg in (GenerateMsg("ok", [1], greedy), GenerateMsg("long", [1] * 9, greedy),
                    GenerateMsg("slow", [1], SamplingParams(max_tokens=10**6)), StatsQueryMsg(4)):  # fmt: skip
            api_push.send(encode(msg))
        thread.start()
        replies = [decode_from_engine(api_pull.recv()) for _ in range(4)]
        assert replies[0] == AcceptedMsg("ok")
        assert isinstance(replies[1], RejectedMsg) and replies[1].error_class == "ContextLengthExceededError"
        assert replies[2] == AcceptedMsg("slow")
        assert isinstance(replies[3], StatsMsg) and replies[3].query_id == 4
        assert replies[3].stats.num_running_reqs == 2
        tokens: dict[str, list[int]] = {"ok": [], "slow": []}
        while True:  # until "ok" finishes after its 3 tokens
            msg = decode_from_engine(api_pull.recv())
            assert isinstance(msg, DeltasMsg)
            for d in msg.deltas:
                tokens[d.rid] += d.new_token_ids
            if any(d.rid == "ok" and d.finished for d in msg.deltas):
                break
        assert tokens["ok"] == [1, 2, 3] and tokens["slow"][:3] == [1, 2, 3]
        api_push.send(encode(ShutdownMsg("test")))
        thread.join(10)
        assert not thread.is_alive()
        assert engine.aborted == ["slow"] and not engine.reqs and loop.active == set()
    finally:
        loop.stopping = True
        thread.join(10)
        for sock in (api_push, engine_pull, engine_push, api_pull):
            sock.close(linger=0)
        ctx.term()


# ------------------------------------------------------------------------------------------------ leaving a group


def test_leave_group_closes_the_engine_before_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's engine releases its CUDA graphs before destroy_process_group (NCCL waits forever on a communicator
    that a live graph's collectives hold); a close that fails still leaves the group."""
    from decode_server.runtime import rank_group

    calls: list[str] = []

    class Closing:
        def __init__(self, fail: bool) -> None:
            self.fail = fail

        def close(self) -> None:
            calls.append("close")
            if self.fail:
                raise RuntimeError("graph reset failed")

    monkeypatch.setattr(rank_group, "destroy_parallel", lambda parallel: calls.append(f"destroy {parallel}"))
    rank_group.leave_group("g", Closing(fail=False))
    assert calls == ["close", "destroy g"]
    calls.clear()
    rank_group.leave_group("g", Closing(fail=True))
    assert calls == ["close", "destroy g"]
    calls.clear()
    rank_group.leave_group("g", None)  # the engine was never built
    assert calls == ["destroy g"]
