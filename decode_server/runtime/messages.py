"""Typed messages between the api process and the engine process, one family per direction, one codec.

The api's `EngineClient` and the runtime's engine loop both import this module, which needs no torch.

api → engine (`ToEngine`): `GenerateMsg`, `AbortMsg`, `StatsQueryMsg`, `FlushCacheMsg`, `ShutdownMsg`.
engine → api (`FromEngine`): `ReadyMsg`, `AcceptedMsg`, `RejectedMsg`, `DeltasMsg`, `StatsMsg`, `FlushedMsg`,
`FatalMsg`, `HeartbeatMsg`.

The codec is pickle of these small dataclasses: both ends run the same code from the same installation, the
sockets are local ipc paths inside a private temporary directory, and pickling keeps `SamplingParams`,
`RequestDelta` and `EngineStats` typed end to end without a schema to keep in sync. `decode` refuses any
object that is not a message of the expected direction, so a stray message fails loudly.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import decode_server.errors as errors_module
from decode_server.disagg.bootstrap_info import BootstrapInfo
from decode_server.engine.sampling_params import SamplingParams
from decode_server.errors import DecodeServerError

# ------------------------------------------------------------------------------------------ api → engine


@dataclass(frozen=True)
class GenerateMsg:
    rid: str
    prompt_token_ids: list[int]
    params: SamplingParams
    bootstrap: BootstrapInfo | None = None  # PD disaggregation (prefill/decode modes)
    dp_rank: int = 0  # data-parallel attention: the rank that serves it (the api balances them)


@dataclass(frozen=True)
class AbortMsg:
    """Abort one request (`rid`) or, with `rid=None`, every request the engine holds."""

    rid: str | None


@dataclass(frozen=True)
class StatsQueryMsg:
    query_id: int


@dataclass(frozen=True)
class FlushCacheMsg:
    """Drop the prefix cache's unused pages (/flush_cache); answered by a `FlushedMsg` of the same id."""

    query_id: int


@dataclass(frozen=True)
class ShutdownMsg:
    reason: str = "server shutting down"


ToEngine = GenerateMsg | AbortMsg | StatsQueryMsg | FlushCacheMsg | ShutdownMsg

# ------------------------------------------------------------------------------------------ engine → api


@dataclass(frozen=True)
class ReadyMsg:
    """The engine is loaded and looping. `info`: model, mode, context length, memory budgets (for logs)."""

    pid: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AcceptedMsg:
    rid: str


@dataclass(frozen=True)
class RejectedMsg:
    """`Engine.add_request` raised; the error travels as (class name, message, param) and is rebuilt."""

    rid: str
    error_class: str
    message: str
    param: str | None = None

    @classmethod
    def from_exception(cls, rid: str, exc: Exception) -> RejectedMsg:
        if isinstance(exc, DecodeServerError):
            return cls(rid, type(exc).__name__, exc.message, exc.param)
        return cls(rid, "DecodeServerError", f"engine could not add the request: {type(exc).__name__}: {exc}")

    def to_exception(self) -> DecodeServerError:
        error_cls = _ERRORS_BY_NAME.get(self.error_class, DecodeServerError)
        return error_cls(self.message, param=self.param)


@dataclass(frozen=True)
class DeltasMsg:
    """Everything one engine step produced: a list of `decode_server.engine.RequestDelta`."""

    deltas: list[Any]


@dataclass(frozen=True)
class StatsMsg:
    query_id: int
    stats: Any  # decode_server.engine.EngineStats


@dataclass(frozen=True)
class FlushedMsg:
    """The answer to `FlushCacheMsg`: tokens of cached KV dropped (summed over DP ranks)."""

    query_id: int
    dropped_tokens: int


@dataclass(frozen=True)
class FatalMsg:
    """The engine loop raised; the process exits after sending this."""

    message: str


@dataclass(frozen=True)
class HeartbeatMsg:
    """Sent by a thread of the engine process every `heartbeat.HEARTBEAT_PERIOD_S`, whatever the loop is doing.

    `num_loops` counts loop iterations (progress); `step_running_s` is how long the current `Engine.step()` has
    been running (0 between steps), so the api can tell "alive, in a long step" from "stopped" (no heartbeat)."""

    pid: int
    num_loops: int
    step_running_s: float


FromEngine = ReadyMsg | AcceptedMsg | RejectedMsg | DeltasMsg | StatsMsg | FlushedMsg | FatalMsg | HeartbeatMsg

_TO_ENGINE = (GenerateMsg, AbortMsg, StatsQueryMsg, FlushCacheMsg, ShutdownMsg)
_FROM_ENGINE = (ReadyMsg, AcceptedMsg, RejectedMsg, DeltasMsg, StatsMsg, FlushedMsg, FatalMsg, HeartbeatMsg)

# Every typed error in decode_server.errors keeps its class (and so its HTTP status) across the boundary.
_ERRORS_BY_NAME: dict[str, type[DecodeServerError]] = {
    name: value
    for name, value in vars(errors_module).items()
    if isinstance(value, type) and issubclass(value, DecodeServerError)
}


def encode(msg: ToEngine | FromEngine) -> bytes:
    if not isinstance(msg, _TO_ENGINE + _FROM_ENGINE):
        raise TypeError(f"not a message: {type(msg).__name__}")
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode_to_engine(data: bytes) -> ToEngine:
    msg = pickle.loads(data)
    if not isinstance(msg, _TO_ENGINE):
        raise TypeError(f"engine received a message of unexpected type {type(msg).__name__}")
    return msg


def decode_from_engine(data: bytes) -> FromEngine:
    msg = pickle.loads(data)
    if not isinstance(msg, _FROM_ENGINE):
        raise TypeError(f"api received a message of unexpected type {type(msg).__name__}")
    return msg
