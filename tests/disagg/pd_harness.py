"""Real prefill and decode servers for the PD tests: `decode-server serve --disaggregation-mode ...` subprocesses
on 127.0.0.1 (tests/api/api_server_harness.py's `ServerProcess`), real mooncake over TCP between them, and the
checks that every pool, staging row and room is free again on both sides."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))

from api_server_harness import ServerProcess, free_port, wait_until_idle  # noqa: E402
from api_server_harness import flush_cache as flush_cache  # noqa: E402  (re-exported for the PD tests)

MODEL = "tiny-dsa"
# D = the model's index_topk (64): prompts longer than that swap rows in from the host pool during decode.
HISPARSE_CONFIG = '{"device_buffer_size": 64, "num_recent_slots": 4}'
SMALL_POOLS = ["--device-kv-budget", "32MiB", "--host-kv-budget", "64MiB", "--page-size", "16"]
# Short timeouts so that fault tests end quickly (the waiting timeout is per decode server: it must cover the
# prefill's compute time of everything queued before a request, which under load takes a while on CPU).
FAST_TIMEOUTS = ["--disaggregation-bootstrap-timeout", "4", "--disaggregation-heartbeat-interval", "0.5",
                 "--disaggregation-heartbeat-max-failures", "2"]


class PrefillServer(ServerProcess):
    def __init__(self, *extra: str) -> None:
        self.bootstrap_port = free_port()
        super().__init__("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                         str(self.bootstrap_port), *SMALL_POOLS, *FAST_TIMEOUTS, *extra)

    def route(self, room: int) -> dict:
        """What a router adds to a request body to pair it with this prefill server."""
        return {"bootstrap_host": "127.0.0.1", "bootstrap_port": self.bootstrap_port, "bootstrap_room": room}


def decode_server(*extra: str, hisparse: bool = True, waiting_timeout_s: float = 120) -> ServerProcess:
    args = ["--disaggregation-mode", "decode", *SMALL_POOLS, *FAST_TIMEOUTS, "--disaggregation-waiting-timeout",
            str(waiting_timeout_s), *extra]
    if hisparse:
        args += ["--enable-hisparse", "--hisparse-config", HISPARSE_CONFIG]
    return ServerProcess(*args)


def start_all(*servers: ServerProcess) -> None:
    """The servers start in parallel (each loads the model); wait for all, killing every one on failure."""
    try:
        for s in servers:
            s.wait_ready()
    except BaseException:
        for s in servers:
            s.kill()
        raise


def disagg_stats(server: ServerProcess) -> dict:
    return server.stats()["disagg"]


def wait_pd_idle(server: ServerProcess, timeout: float = 30.0) -> dict:
    """Every KV pool empty (wait_until_idle) and nothing of PD left: no room in flight, no held or waiting
    request, no staging or aux row in use."""
    deadline = time.monotonic() + timeout
    d: dict = {}
    while time.monotonic() < deadline:
        wait_until_idle(server, timeout)
        d = disagg_stats(server)
        busy = (d["rooms_by_state"] or d["num_bootstrapping_reqs"] or d["num_inflight_reqs"]
                or d["num_transferring_reqs"] or d["num_prealloc_reqs"] or d["staging_rows"]["used"]
                or d["aux_rows_used"])
        if not busy:
            return d
        time.sleep(0.1)
    raise AssertionError(f"PD state not idle after {timeout} s: {d}")


def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def refused_completion(server: ServerProcess, body: dict) -> openai.APIStatusError:
    """A completion that must fail, sent with the openai client as a router would: the error it raised (its HTTP
    status and OpenAI-style message)."""

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
            return await c.completions.create(**body)

    with pytest.raises(openai.APIStatusError) as err:
        asyncio.run(run())
    return err.value
