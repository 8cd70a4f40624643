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
on both workers by name; the response the client gets carries that id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from decode_server.api.errors import error_body, validation_error_response
from decode_server.api.protocol import ChatCompletionRequest, CompletionRequest
from decode_server.router.config import RouterConfig
from decode_server.router.metrics import RouterMetrics
from decode_server.router.policy import make_policy
from decode_server.router.workers import WORKER_ERRORS, Worker, WorkerPool

logger = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0
FORWARDED_HEADERS = ("authorization", "x-api-key")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
RETRY_AFTER = {"Retry-After": "1"}


@dataclass(frozen=True)
class Route:
    path: str  # the same path on the workers
    id_prefix: str  # of the request id, as the servers name their responses
    model: type[BaseModel]  # the servers' own request model: same validation, same errors


COMPLETIONS = Route("/v1/completions", "cmpl", CompletionRequest)
CHAT = Route("/v1/chat/completions", "chatcmpl", ChatCompletionRequest)


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
        self.prefill_policy = make_policy(config.policy)
        self.decode_policy = make_policy(config.policy)
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
        self.metrics.requests.labels(worker.role, worker.url, outcome).inc()

    def _begin(self, worker: Worker) -> None:
        worker.inflight += 1
        self.metrics.inflight.labels(worker.role, worker.url).set(worker.inflight)

    def _end(self, worker: Worker) -> None:
        worker.inflight -= 1
        self.metrics.inflight.labels(worker.role, worker.url).set(worker.inflight)

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

    def _forwarded(self, request: Request) -> dict[str, str]:
        headers = {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k))}
        headers["content-type"] = "application/json"
        return headers

    # -------------------------------------------------------------------------------------- entry

    async def handle(self, request: Request, route: Route) -> Response:
        arrival = time.perf_counter()
        response = await self._handle(request, route, arrival)
        self.metrics.client_requests.labels(route.path, str(response.status_code)).inc()
        if not isinstance(response, StreamingResponse):
            self.metrics.latency.labels(route.path).observe(time.perf_counter() - arrival)
        return response

    async def _handle(self, request: Request, route: Route, arrival: float) -> Response:
        raw = await request.body()
        parsed = self._validate(raw, route)
        if isinstance(parsed, Response):
            return parsed
        body = parsed
        headers = self._forwarded(request)
        tried: set[Worker] = set()
        last_reason = "no attempt made"
        for attempt in range(self.config.retry_max_retries + 1):
            prefill = self.prefill_policy.pick(self.pool.prefill, tried)
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
                return await self._attempt(request, route, body, headers, prefill, decode, arrival)
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
        request: Request,
        route: Route,
        body: dict[str, Any],
        headers: dict[str, str],
        prefill: Worker,
        decode: Worker,
        arrival: float,
    ) -> Response:
        rid = f"{route.id_prefix}-{uuid.uuid4().hex}"
        payload = dict(body, rid=rid, bootstrap_host=prefill.bootstrap_host, bootstrap_port=prefill.bootstrap_port,
                       bootstrap_room=_rooms(body))  # fmt: skip
        content = json.dumps(payload, separators=(",", ":")).encode()
        pair = _Pair(self, rid, headers, prefill, decode)
        pair.prefill_task = asyncio.create_task(self._send(prefill, route.path, content, headers))
        pair.decode_task = asyncio.create_task(self._send(decode, route.path, content, headers))
        disconnect = asyncio.create_task(_wait_for_disconnect(request))
        deadline = time.monotonic() + self.config.request_timeout_secs
        try:
            pending: set[asyncio.Task[Any]] = {pair.prefill_task, pair.decode_task, disconnect}
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
                if disconnect in done:
                    logger.info("client of %s disconnected before the answer; aborting on both workers", rid)
                    self._count(decode, "aborted")
                    pair.give_up()
                    return _error("client disconnected", "aborted", 499)
                if pair.prefill_task in done:
                    refusal = await self._prefill_answered(pair)
                    if refusal is not None:
                        return refusal
            disconnect.cancel()
            return await self._decode_answered(route, pair, arrival)
        except BaseException:
            pair.give_up()
            raise
        finally:
            disconnect.cancel()
            pair.settle_prefill()

    async def _send(
        self, worker: Worker, path: str, content: bytes, headers: dict[str, str]
    ) -> aiohttp.ClientResponse:
        """POST; returns once the response headers came (the body is read by the caller)."""
        return await self.client.post(worker.url + path, data=content, headers=headers)

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

    async def _decode_answered(self, route: Route, pair: _Pair, arrival: float) -> Response:
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
        self.metrics.ttfb.labels(route.path).observe(time.perf_counter() - arrival)
        pair.decode_owned = False  # from here on the relay (or the code below) settles decode
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            return self._relay(route, pair, resp, arrival)
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

    def _relay(self, route: Route, pair: _Pair, resp: aiohttp.ClientResponse, arrival: float) -> StreamingResponse:
        """decode's SSE bytes, chunk by chunk, unchanged; an error event if decode fails mid-stream."""
        decode, rid = pair.decode, pair.rid
        state = {"settled": False}

        def settle(finished: bool) -> None:
            # Runs once, with no await: when the client left, this runs inside a cancelled scope.
            if state["settled"]:
                return
            state["settled"] = True
            if finished:
                resp.release()  # the connection goes back to the pool
            else:
                resp.close()  # decode sees the connection drop (and gets the abort)
            self._end(decode)
            self.metrics.latency.labels(route.path).observe(time.perf_counter() - arrival)
            if not finished:
                logger.info("client of %s disconnected mid-stream; aborting on both workers", rid)
                self._count(decode, "aborted")
                pair.abort_decode()
                pair.abort_prefill()

        async def chunks() -> AsyncIterator[bytes]:
            finished = False
            last = b"\n\n"
            try:
                async for chunk in resp.content.iter_any():
                    if chunk:
                        last = chunk
                        yield chunk
                finished = True
                self._count(decode, "success")
            except WORKER_ERRORS as exc:
                finished = True
                logger.warning("decode worker %s failed mid-stream of %s: %s", decode.url, rid, exc)
                self._count(decode, "stream_error")
                pair.abort_prefill()
                pair.abort_decode()  # it may only be slow: free the request there too
                prefix = b"" if last.endswith(b"\n\n") else b"\n\n"  # end a frame cut in the middle first
                kind = "timed out" if isinstance(exc, asyncio.TimeoutError) else "failed"
                yield prefix + _sse_error(f"decode worker {decode.url} {kind} mid-stream ({type(exc).__name__})",
                                          "worker_failed", 502)  # fmt: skip
            finally:
                settle(finished)

        return _RelayResponse(chunks(), settle)


class _RelayResponse(StreamingResponse):
    """A StreamingResponse that settles its relay even when the body iterator never started (the client left
    before the first chunk: Starlette then cancels the response without running the generator's `finally`)."""

    def __init__(self, content: AsyncIterator[bytes], settle: Any) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._settle = settle

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._settle(False)  # a no-op when the generator settled already


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


def _rooms(body: dict[str, Any]) -> int | list[int]:
    """A random room in [0, 2^63); a batched completion (a list of prompts) gets one room per prompt, as SGLang's
    router sends it (each prompt is its own transfer)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return [random.getrandbits(63) for _ in prompt]
    return random.getrandbits(63)


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


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away. Only used after the body was read and before a response starts."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
