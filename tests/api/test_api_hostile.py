"""Every hand-written hostile body (tests/api/hostile_bodies.py) gets an answer below 500, and the server is idle
and healthy afterwards."""

from __future__ import annotations

import httpx
import pytest
from api_server_harness import ServerProcess, wait_until_idle
from hostile_bodies import HOSTILE_BODIES, LEGAL


@pytest.mark.parametrize(("name", "route", "body"), HOSTILE_BODIES, ids=[n for n, _, _ in HOSTILE_BODIES])
def test_hostile_body_is_not_a_server_error(dense_server: ServerProcess, name: str, route: str,
                                            body: bytes) -> None:  # fmt: skip
    r = httpx.post(dense_server.url + route, content=body, timeout=120,
                   headers={**dense_server.headers, "content-type": "application/json"})  # fmt: skip
    assert r.status_code < 500, (name, r.status_code, r.text[:300])
    assert (r.status_code == 200) == (name in LEGAL), (name, r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["code"] == r.status_code and err["message"] and err["type"], (name, err)


def test_server_is_idle_and_healthy_after_the_hostile_bodies(dense_server: ServerProcess) -> None:
    wait_until_idle(dense_server, timeout=60)
    assert httpx.get(dense_server.url + "/health", timeout=10).status_code == 200
