"""One client request through the router: validate, pick a pair, send to both, return decode's answer.

Failure behaviour:
- a worker unreachable (or refusing with 503) before decode's first byte: abort whatever the other worker of
  the pair started, take the unreachable worker out of rotation, and try another pair (bounded retries, with a
  short pause); then a 503 OpenAI-style error;
- prefill refusing the request (a 4xx) before decode answered: prefill's error is the answer (decode would only
  wait for KV that never comes, so it is aborted);
- decode failing after the first byte: the stream ends with an error event and `[DONE]`;
- the client going away: `POST /abort_request {"rid"}` to both workers, so they free the request at once.

The router sets the engine-visible request id (`rid` in the body, e.g. `cmpl-<hex>`), so it can abort the request
on both workers by name; the response the client gets carries that id. Rooms are 128 random bits from `secrets`
(unguessable); with the deployment's PD secret the router also signs the bootstrap fields it issues
(`bootstrap_auth`), and servers holding the secret accept no PD request without that signature. With
`--worker-api-key` every worker call carries that key instead of the client's credentials.

This is the router's hot path, so it is plain ASGI (no FastAPI routing, dependency or response machinery, no
task group per stream): decode's SSE bytes are relayed as they arrive, unparsed, one `send` per read; one task
per request watches for the client leaving, and when it leaves mid-stream that task cancels the relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from decode_server.api.errors import error_body, validation_error_response
from decode_server.api.native_protocol import GenerateRequest
from decode_server.api.protocol import ChatCompletionRequest, CompletionRequest
from decode_server.router.config import RouterConfig
from decode_server.router.metrics import RouterMetrics
from decode_server.router.policy import make_policy
from decode_server.router.prefix_affinity import affinity_text
from decode_server.router.workers import WORKER_ERRORS, Worker, WorkerPool
from transfer.auth import PDAuth

logger = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0
FORWARDED_HEADERS = (b"authorization", b"x-api-key")
RETRY_AFTER = {"Retry-After": "1"}
# The relay's ASGI messages that never change (uvicorn only reads them).
_SSE_START: Message = {"type": "http.response.start", "status": 200, "headers": [
    (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no")]}  # fmt: skip
_BODY_END: Message = {"type": "http.response.body", "body": b"", "more_body": False}


@dataclass(frozen=True)
class Route:
    path: str  # the same path on the workers
    id_prefix: str  # of the request id, as the servers name their responses
    model: type[BaseModel]  # the servers' own request model: same validation, same errors


COMPLETIONS = Route("/v1/completions", "cmpl", CompletionRequest)
CHAT = Route("/v1/chat/completions", "chatcmpl", ChatCompletionRequest)
GENERATE = Route("/generate", "gen", GenerateRequest)  # SGLang's native API


class _Retry(Exception):
    """This pair failed before any byte reached the client; `worker` should not be tried again."""

    def __init__(self, worker: Worker, reason: str) -> None:
        super().__init__(reason)
        self.worker = worker
        self.reason = reason


def _error(message: str, error_type: str, status: int, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, error_type, status), status_code=status, headers=headers)


def _sse_error(message: str, error_type: str, status: int) -> bytes:
    body = json.dumps(error_body(message, error_type, status), separators=(",", ":"))
    return f"data: {body}\n\ndata: [DONE]\n\n".encode()


class Dispatcher:
    def __init__(
        self, config: RouterConfig, pool: WorkerPool, client: aiohttp.ClientSession, metrics: RouterMetrics
    ) -> None:
        self.config = config
        self.pool = pool
        self.client = client
        self.metrics = metrics
        self.prefill_policy = make_policy(config.resolved_prefill_policy, config, self.metrics.count_cache_aware)
        self.decode_policy = make_policy(config.resolved_decode_policy, config)
        self.auth = PDAuth.from_file(config.disaggregation_auth_secret_file)
        self._background: set[asyncio.Task[Any]] = set()

    # -------------------------------------------------------------------------------------- helpers

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run cleanup work that must outlive the request (draining prefill, aborts); keep a reference."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain_background(self, timeout: float) -> None:
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)

    def _count(self, worker: Worker, outcome: str) -> None:
        self.metrics.count_request(worker.role, worker.url, outcome)

    def _begin(self, worker: Worker) -> None:
        worker.inflight += 1
        self.metrics.set_inflight(worker.role, worker.url, worker.inflight)

    def _end(self, worker: Worker) -> None:
        worker.inflight -= 1
        self.metrics.set_inflight(worker.role, worker.url, worker.inflight)

    async def _abort(self, worker: Worker, rid: str, headers: dict[str, str]) -> None:
        self.metrics.aborts.labels(worker.role, worker.url).inc()
        try:
            async with self.client.post(worker.url + "/abort_request", json={"rid": rid}, headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S)) as resp:  # fmt: skip
                await resp.read()
        except WORKER_ERRORS as exc:
            logger.info("abort of %s at %s failed: %r", rid, worker.url, exc)

    def _abort_later(self, worker: Worker, rid: str, headers: dict[str, str]) -> None:
        self.spawn(self._abort(worker, rid, headers))

    async def _drain_prefill(self, worker: Worker, task: asyncio.Task[aiohttp.ClientResponse]) -> None:
        """Wait for prefill's answer and read it to the end (its connection returns to the pool); its content is
        not used, and a failure after decode answered only counts in the metrics."""
        try:
            try:
                resp = await task
            except WORKER_ERRORS as exc:
                self._count(worker, "unreachable" if _refused(exc) else "server_error")
                return
            try:
                async for _ in resp.content.iter_any():
                    pass
                self._count(worker, "success" if resp.status == 200 else
                            "server_error" if resp.status >= 500 else "client_error")  # fmt: skip
                resp.release()
            except WORKER_ERRORS as exc:
                logger.info("prefill %s: response ended with %r", worker.url, exc)
                self._count(worker, "stream_error")
            finally:
                resp.close()
        finally:
            self._end(worker)

    def _forwarded(self, scope: Scope) -> dict[str, str]:
        """Without `--worker-api-key` the client's credentials go on to the workers (one key for the router and
        the servers); with it, the client's stay here and the worker key (a default header of the client
        session) goes instead."""
        headers: dict[str, str] = {}
        if self.config.worker_api_key is None:
            for name, value in scope["headers"]:
                if name in FORWARDED_HEADERS and value:
                    headers.setdefault(name.decode(), value.decode("latin-1"))
        headers["content-type"] = "application/json"
        return headers

    # -------------------------------------------------------------------------------------- entry

    async def handle(self, scope: Scope, receive: Receive, send: Send, route: Route) -> None:
        """The ASGI handler of one POST to `route`."""
        arrival = time.perf_counter()
        raw = await _read_body(receive)
        if raw is None:  # the client left before its body arrived: nothing to answer, nothing sent anywhere
            self.metrics.count_client(route.path, 499)
            return
        watch = _ClientWatch(receive)
        try:
            try:
                response = await self._handle(scope, raw, route, arrival, watch)
            except Exception:
                logger.exception("unexpected error while routing a request")
                response = _error("internal error of the router", "internal_error", 500)
            self.metrics.count_client(route.path, response.status_code)
            await response(scope, receive, send)
            if not isinstance(response, _Relay):
                self.metrics.observe_latency(route.path, time.perf_counter() - arrival)
        finally:
            watch.close()

    async def _handle(self, scope: Scope, raw: bytes, route: Route, arrival: float,
                      watch: _ClientWatch) -> Response | _Relay:  # fmt: skip
        parsed = self._validate(raw, route)
        if isinstance(parsed, Response):
            return parsed
        body = parsed
        headers = self._forwarded(scope)
        tried: set[Worker] = set()
        last_reason = "no attempt made"
        text = affinity_text(body) if self.prefill_policy.uses_text else ""
        for attempt in range(self.config.retry_max_retries + 1):
            prefill = self.prefill_policy.pick(self.pool.prefill, tried, text)
            decode = self.decode_policy.pick(self.pool.decode, tried)
            if prefill is None or decode is None:
                missing = "prefill" if prefill is None else "decode"
                message = f"no healthy {missing} worker"
                if attempt:
                    message += f" (last failure: {last_reason})"
                return _error(message, "workers_unavailable", 503, RETRY_AFTER)
            if attempt:
                self.metrics.retries.inc()
                await asyncio.sleep(self.config.retry_backoff_ms / 1000 * attempt)
            else:
                self.metrics.dispatch.observe(time.perf_counter() - arrival)
            try:
                return await self._attempt(watch, route, body, headers, prefill, decode, arrival)
            except _Retry as retry:
                tried.add(retry.worker)
                last_reason = retry.reason
                logger.warning("%s (attempt %d of %d)", retry.reason, attempt + 1,
                               self.config.retry_max_retries + 1)  # fmt: skip
        return _error(
            f"no worker pair could take the request after {self.config.retry_max_retries + 1} attempts "
            f"(last failure: {last_reason})",
            "workers_unavailable", 503, RETRY_AFTER,
        )  # fmt: skip

    @staticmethod
    def _validate(raw: bytes, route: Route) -> dict[str, Any] | Response:
        """The servers' own checks of the JSON and its shape, so bad input never reaches a worker."""
        try:
            body = json.loads(raw) if raw else None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(f"request body is not valid JSON: {exc}", "invalid_request_error", 400)
        if body is None:
            return _error("request body is required", "invalid_request_error", 400)
        if not isinstance(body, dict):
            return _error("request body must be a JSON object", "invalid_request_error", 400)
        try:
            route.model.model_validate(body)
        except ValidationError as exc:
            return validation_error_response(exc.errors())
        return body

    # -------------------------------------------------------------------------------------- one pair

    async def _attempt(
        self,
        watch: _ClientWatch,
        route: Route,
        body: dict[str, Any],
        headers: dict[str, str],
        prefill: Worker,
        decode: Worker,
        arrival: float,
    ) -> Response | _Relay:
        rid = f"{route.id_prefix}-{uuid.uuid4().hex}"
        payload = dict(body, rid=rid, bootstrap_host=prefill.bootstrap_host, bootstrap_port=prefill.bootstrap_port,
                       bootstrap_room=_rooms(body))  # fmt: skip
        if self.auth is not None:
            payload["bootstrap_auth"] = self.auth.sign_ticket(payload["bootstrap_host"], payload["bootstrap_port"],
                                                              payload["bootstrap_room"])  # fmt: skip
        else:
            payload.pop("bootstrap_auth", None)  # only the router issues rooms
        content = json.dumps(payload, separators=(",", ":")).encode()
        pair = _Pair(self, rid, headers, prefill, decode)
        # Both requests go out at once: prefill's answer never delays decode's first byte.
        pair.prefill_task = asyncio.create_task(self._send(prefill, route.path, content, headers))
        pair.decode_task = asyncio.create_task(self._send(decode, route.path, content, headers))
        deadline = time.monotonic() + self.config.request_timeout_secs
        try:
            pending: set[asyncio.Future[Any]] = {pair.prefill_task, pair.decode_task, watch.task}
            while not pair.decode_task.done():
                remaining = max(deadline - time.monotonic(), 0.0)
                done, pending = await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                if pair.decode_task.done():
                    break
                if not done:
                    self._count(decode, "timeout")
                    pair.give_up()
                    return _error(f"no answer from decode worker {decode.url} within "
                                  f"{self.config.request_timeout_secs:g} s", "worker_timeout", 504)  # fmt: skip
                if watch.task in done:
                    logger.info("client of %s disconnected before the answer; aborting on both workers", rid)
                    self._count(decode, "aborted")
                    pair.give_up()
                    return _error("client disconnected", "aborted", 499)
                if pair.prefill_task in done:
                    refusal = await self._prefill_answered(pair)
                    if refusal is not None:
                        return refusal
            return await self._decode_answered(route, pair, arrival, watch)
        except BaseException:
            pair.give_up()
            raise
        finally:
            pair.settle_prefill()

    async def _send(
        self, worker: Worker, path: str, content: bytes, headers: dict[str, str]
    ) -> aiohttp.ClientResponse:
        """POST; returns once the response headers came (the body is read by the caller)."""
        return await self.client.post(worker.endpoint(path), data=content, headers=headers)

    async def _prefill_answered(self, pair: _Pair) -> Response | None:
        """Prefill's headers came before decode's: None if it accepted (then it is drained in the background);
        otherwise its refusal is the answer, or `_Retry` is raised when it was unreachable or overloaded."""
        prefill, task = pair.prefill, pair.prefill_task
        exc = task.exception()
        if exc is not None:
            retry = self._unreachable(prefill, exc)
            pair.give_up()
            raise retry
        resp = task.result()
        if resp.status == 200:
            pair.settle_prefill()
            return None
        # Refused: it holds nothing, so no abort there; decode would wait for KV that never comes.
        pair.prefill_owned = False
        self._end(prefill)
        pair.give_up()
        body = await _read_closing(resp)
        self._count(prefill, "server_error" if resp.status >= 500 else "client_error")
        if resp.status == 503:
            raise _Retry(prefill, f"prefill worker {prefill.url} refused with 503: {body[:200]!r}")
        return Response(body, status_code=resp.status, media_type=resp.headers.get("content-type"))

    def _unreachable(self, worker: Worker, exc: BaseException) -> _Retry:
        if not isinstance(exc, WORKER_ERRORS):
            raise exc
        self._count(worker, "unreachable")
        # A refused connection means the worker is gone: out of rotation until a health check passes.
        self.pool.record_failure(worker, f"{type(exc).__name__}: {exc}", at_once=_refused(exc))
        return _Retry(worker, f"{worker.role} worker {worker.url} unreachable ({type(exc).__name__}: {exc})")

    async def _decode_answered(self, route: Route, pair: _Pair, arrival: float,
                               watch: _ClientWatch) -> Response | _Relay:  # fmt: skip
        decode, task = pair.decode, pair.decode_task
        exc = task.exception()
        if exc is not None:
            retry = self._unreachable(decode, exc)
            pair.give_up()
            raise retry
        resp = task.result()
        if resp.status != 200:
            # Decode refused: nothing runs there; prefill is aborted (it would wait for a decode that never comes).
            pair.decode_owned = False
            self._end(decode)
            pair.give_up()
            body = await _read_closing(resp)
            self._count(decode, "server_error" if resp.status >= 500 else "client_error")
            if resp.status == 503:
                raise _Retry(decode, f"decode worker {decode.url} refused with 503: {body[:200]!r}")
            return Response(body, status_code=resp.status, media_type=resp.headers.get("content-type"))
        self.metrics.observe_ttfb(route.path, time.perf_counter() - arrival)
        pair.decode_owned = False  # from here on the relay (or the code below) settles decode
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            return _Relay(self, route, pair, resp, arrival, watch)
        try:
            body = await resp.read()
        except WORKER_ERRORS as e:
            self._count(decode, "stream_error")
            pair.abort_prefill()
            return _error(f"decode worker {decode.url} failed while answering ({type(e).__name__})",
                          "worker_failed", 502)  # fmt: skip
        finally:
            self._end(decode)
            resp.release()
        self._count(decode, "success")
        return Response(body, status_code=200, media_type=resp.headers.get("content-type"))


class _ClientWatch:
    """One task per request that returns when the client goes away (ASGI `http.disconnect`).

    Before decode answers, `_attempt` waits on `task` next to the worker requests. While a relay runs it is
    `arm`ed: a disconnect then cancels the relaying task (which stops reading from decode at once, even when
    decode is silent), and `cancelled_target` tells the relay that the cancellation was this one."""

    __slots__ = ("task", "_target", "cancelled_target")

    def __init__(self, receive: Receive) -> None:
        self.task: asyncio.Task[None] = asyncio.get_running_loop().create_task(_wait_for_disconnect(receive))
        self._target: asyncio.Task[Any] | None = None
        self.cancelled_target = False
        self.task.add_done_callback(self._on_done)

    def arm(self) -> bool:
        """From now on a disconnect cancels the calling task; False (and nothing armed): the client already left."""
        if self.task.done():
            return False
        self._target = asyncio.current_task()
        return True

    def disarm(self) -> None:
        self._target = None

    def _on_done(self, task: asyncio.Task[None]) -> None:
        target, self._target = self._target, None
        if target is not None and not task.cancelled() and task.exception() is None:
            self.cancelled_target = True
            target.cancel()

    def close(self) -> None:
        self._target = None
        self.task.cancel()


class _Relay:
    """decode's SSE bytes to the client, as they arrive, unchanged; an error event if decode fails mid-stream.

    An ASGI response: `Dispatcher.handle` calls it. It settles decode (count, release or close, and abort on both
    workers when the client left before the end) exactly once, whichever way it ends."""

    status_code = 200

    def __init__(self, d: Dispatcher, route: Route, pair: _Pair, resp: aiohttp.ClientResponse, arrival: float,
                 watch: _ClientWatch) -> None:  # fmt: skip
        self.d, self.route, self.pair, self.resp, self.arrival, self.watch = d, route, pair, resp, arrival, watch

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        decode, rid = self.pair.decode, self.pair.rid
        finished = False  # decode's stream is over (complete, or failed and handled)
        if not self.watch.arm():
            self._settle(False)
            return
        try:
            try:
                await send(_SSE_START)
                read = self.resp.content.readany
                last = b"\n\n"
                while chunk := await read():
                    last = chunk
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                finished = True
                self.d._count(decode, "success")
            except WORKER_ERRORS as exc:
                finished = True
                logger.warning("decode worker %s failed mid-stream of %s: %s", decode.url, rid, exc)
                self.d._count(decode, "stream_error")
                self.pair.abort_prefill()
                self.pair.abort_decode()  # it may only be slow: free the request there too
                prefix = b"" if last.endswith(b"\n\n") else b"\n\n"  # end a frame cut in the middle first
                kind = "timed out" if isinstance(exc, asyncio.TimeoutError) else "failed"
                error = _sse_error(f"decode worker {decode.url} {kind} mid-stream ({type(exc).__name__})",
                                   "worker_failed", 502)  # fmt: skip
                await send({"type": "http.response.body", "body": prefix + error, "more_body": True})
            await send(_BODY_END)
        except asyncio.CancelledError:
            if not self.watch.cancelled_target:
                raise  # not the client leaving (e.g. shutdown): settled below, then passed on
            asyncio.current_task().uncancel()  # type: ignore[union-attr]  # ours: the client left
        finally:
            self.watch.disarm()
            self._settle(finished)

    def _settle(self, finished: bool) -> None:
        decode = self.pair.decode
        if finished:
            self.resp.release()  # the connection goes back to the pool
        else:
            self.resp.close()  # decode sees the connection drop (and gets the abort)
        self.d._end(decode)
        self.d.metrics.observe_latency(self.route.path, time.perf_counter() - self.arrival)
        if not finished:
            logger.info("client of %s disconnected mid-stream; aborting on both workers", self.pair.rid)
            self.d._count(decode, "aborted")
            self.pair.abort_decode()
            self.pair.abort_prefill()


class _Pair:
    """The two worker requests of one attempt, and who still has to settle each (count, close, abort)."""

    def __init__(self, d: Dispatcher, rid: str, headers: dict[str, str], prefill: Worker, decode: Worker) -> None:
        self.d, self.rid, self.headers, self.prefill, self.decode = d, rid, headers, prefill, decode
        self.prefill_task: asyncio.Task[aiohttp.ClientResponse]
        self.decode_task: asyncio.Task[aiohttp.ClientResponse]
        self.prefill_owned = self.decode_owned = True
        d._begin(prefill)
        d._begin(decode)

    def abort_prefill(self) -> None:
        self.d._abort_later(self.prefill, self.rid, self.headers)

    def abort_decode(self) -> None:
        self.d._abort_later(self.decode, self.rid, self.headers)

    def give_up(self) -> None:
        """Drop both requests (idempotent): close the connections and tell both workers to free the request."""
        for owned, worker, task in (("prefill_owned", self.prefill, self.prefill_task),
                                    ("decode_owned", self.decode, self.decode_task)):  # fmt: skip
            if getattr(self, owned):
                setattr(self, owned, False)
                refused = task.done() and not task.cancelled() and task.exception() is None \
                    and task.result().status != 200  # fmt: skip
                self.d.spawn(_close_task(task))
                if not refused:  # a worker that refused the request holds nothing for it
                    self.d._abort_later(worker, self.rid, self.headers)
                self.d._end(worker)

    def settle_prefill(self) -> None:
        """Prefill is still ours and decode is being answered: its response is drained and ignored."""
        if not self.prefill_owned:
            return
        self.prefill_owned = False
        self.d.spawn(self.d._drain_prefill(self.prefill, self.prefill_task))


ROOM_BITS = 128


def _rooms(body: dict[str, Any]) -> int | list[int]:
    """A random room of 128 bits from `secrets` (nobody can guess a room in flight); a batched completion (a list
    of prompts; /generate: a list of texts or of id lists) gets one room per prompt, as SGLang's router sends it
    (each prompt is its own transfer)."""
    for field in ("prompt", "text", "input_ids"):
        prompts = body.get(field)
        if isinstance(prompts, list) and prompts and all(isinstance(p, str | list) for p in prompts):
            return [secrets.randbits(ROOM_BITS) for _ in prompts]
    return secrets.randbits(ROOM_BITS)


async def _read_closing(resp: aiohttp.ClientResponse) -> bytes:
    try:
        return await resp.read()
    except WORKER_ERRORS:
        return b""
    finally:
        resp.release()


async def _close_task(task: asyncio.Task[aiohttp.ClientResponse]) -> None:
    """Cancel a worker request; if its response already came, close it (the connection is dropped)."""
    if not task.done():
        task.cancel()
    with contextlib.suppress(BaseException):
        resp = await task
        resp.close()


def _refused(exc: BaseException) -> bool:
    """The worker is not there at all (connection refused, no route): not a slow or broken answer."""
    return isinstance(exc, aiohttp.ClientConnectorError)


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body; None if the client went away before it ended."""
    message = await receive()
    if message["type"] != "http.request":
        return None
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        return body
    parts = [body]
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)


async def _wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client goes away (or, at the latest, once the response is complete)."""
    while (await receive())["type"] != "http.disconnect":
        pass
