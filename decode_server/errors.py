"""Typed errors raised inside the service; the API edge maps each to an OpenAI-style JSON error and status."""

from __future__ import annotations


class DecodeServerError(Exception):
    """Base class. `status_code` and `error_type` are what the HTTP layer reports."""

    status_code: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(DecodeServerError):
    """The request can never be served as asked (bad parameter, too long, unknown model)."""

    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    """prompt + max_tokens is beyond the model's (or the server's) context length."""


class CapacityError(InvalidRequestError):
    """The request could never fit in the configured KV budgets, even with the server otherwise idle."""


class QueueFullError(DecodeServerError):
    """The waiting queue is at its bound; the client should retry later (HTTP 503 + Retry-After)."""

    status_code = 503
    error_type = "server_overloaded"


class EngineDeadError(DecodeServerError):
    """The engine process is gone; nothing can be served."""

    status_code = 503
    error_type = "engine_unavailable"


class EngineNotRespondingError(EngineDeadError):
    """The engine process sends no heartbeat (stopped, or hung with every thread blocked)."""


class EngineBusyError(DecodeServerError):
    """The engine did not answer a stats query in time (it answers between steps, and one step is long)."""

    status_code = 503
    error_type = "engine_busy"


class TokenizerUnavailableError(DecodeServerError):
    """A tokenizer worker process died while encoding; the pool is restarted and the client may retry."""

    status_code = 503
    error_type = "tokenizer_unavailable"


class AuthenticationError(DecodeServerError):
    status_code = 401
    error_type = "authentication_error"


class PDAuthenticationError(AuthenticationError):
    """A PD request whose bootstrap fields were not signed by an authenticated router (`bootstrap_auth`)."""

    error_type = "pd_authentication_error"


class ServerShuttingDownError(DecodeServerError):
    """The server is stopping (SIGINT/SIGTERM); requests still in flight are aborted with this."""

    status_code = 503
    error_type = "server_shutting_down"


class KVTransferError(DecodeServerError):
    """PD disaggregation: the request's KV could not be moved between the prefill and the decode server (peer
    unreachable or dead, timeout, refused handshake, aborted by the peer). The message says which and why; a
    router may retry the request on another pair."""

    status_code = 503
    error_type = "kv_transfer_failed"


def error_from_name(name: str, message: str, param: str | None = None) -> DecodeServerError:
    """Rebuild a typed error from its class name (errors crossing the engine-process boundary)."""
    cls = globals().get(name)
    if not (isinstance(cls, type) and issubclass(cls, DecodeServerError)):
        cls = DecodeServerError
    return cls(message, param=param)
