"""Fixtures of the API tests. One shared dense server for the whole session (`dense_server`, with an API key);
modules that need other flags, or that kill their server, start their own through `ServerProcess`."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from api_server_harness import API_KEY, CONTEXT_LENGTH, ServerProcess, assert_clean_exit

from decode_server.engine.llm import LLM


@pytest.fixture(scope="session")
def dense_server() -> Iterator[ServerProcess]:
    server = ServerProcess(api_key=API_KEY).wait_ready()
    try:
        yield server
    finally:
        # The shared server also checks the SIGINT path: clean exit, no child process left.
        try:
            code = server.stop(signal.SIGINT)
            assert_clean_exit(server, code)
        finally:
            server.kill()


@pytest.fixture(scope="session")
def offline_llm() -> LLM:
    """The offline API with the servers' engine settings: the reference for greedy outputs (dense mode)."""
    return LLM("tiny-dsa", device="cpu", context_length=CONTEXT_LENGTH)
