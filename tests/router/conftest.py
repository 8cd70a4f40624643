"""Fixtures of the router tests: one set of workers for the session (2 prefill + 2 decode, started once; the
worker launcher is `router_harness.launch_workers`) and a round-robin router in front of them."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from router_harness import CONTEXT_LENGTH, RouterProcess, Worker, launch_workers

from decode_server.engine.llm import LLM


@pytest.fixture(scope="session")
def workers() -> Iterator[tuple[list[Worker], list[Worker]]]:
    prefill, decode = launch_workers(2, 2)
    try:
        yield prefill, decode
    finally:
        for w in prefill + decode:
            try:
                w.server.stop()
            finally:
                w.server.kill()


@pytest.fixture(scope="session")
def router(workers: tuple[list[Worker], list[Worker]]) -> Iterator[RouterProcess]:
    prefill, decode = workers
    r = RouterProcess(prefill, decode, "--policy", "round_robin").wait_ready()
    try:
        yield r
    finally:
        try:
            assert r.stop(signal.SIGTERM) == 0, r.log_text()
        finally:
            r.kill()


@pytest.fixture(scope="session")
def offline_llm() -> LLM:
    """The colocated engine with the servers' settings: the reference for greedy outputs."""
    return LLM("tiny-dsa", device="cpu", context_length=CONTEXT_LENGTH)
