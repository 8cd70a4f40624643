"""Fixtures of the security tests: one authenticated PD pair for the session (prefill + HiSparse decode, a cluster
secret, HTTPS with a test CA, an API key), a decode server holding another secret, and the answer the pair gives
to the reference request when nobody interferes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from security_harness import (
    PROMPTS,
    SecurePrefill,
    SecureServer,
    make_test_pki,
    pd_request,
    secure_decode,
    write_secret,
)

from transfer.auth import PDAuth, load_secret

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def material(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("security")
    return {**make_test_pki(directory), "secret": write_secret(directory, "pd-secret"),
            "other_secret": write_secret(directory, "other-pd-secret")}


@pytest.fixture(scope="session")
def auth(material: dict[str, Path]) -> PDAuth:
    """The deployment's secret, as the router (and these tests, playing the router) hold it."""
    return PDAuth(load_secret(material["secret"]))


@pytest.fixture(scope="session")
def servers(material: dict[str, Path]) -> Iterator[dict[str, SecureServer]]:
    pki = {k: material[k] for k in ("ca", "cert", "key")}
    prefill = SecurePrefill(secret=material["secret"], pki=pki)
    decode = secure_decode(secret=material["secret"], pki=pki)
    stranger = secure_decode(secret=material["other_secret"], pki=None)  # a decode server of another deployment
    everyone = [prefill, decode, stranger]
    try:
        for s in everyone:
            s.wait_ready()
        yield {"prefill": prefill, "decode": decode, "stranger": stranger}
    finally:
        for s in everyone:
            s.kill()


@pytest.fixture(scope="session")
def reference(servers: dict[str, SecureServer], auth: PDAuth) -> list[str]:
    """The pair's greedy text for each of PROMPTS with nobody interfering: what every attacked request must
    still produce."""
    texts = []
    for prompt in PROMPTS:
        status, answer = pd_request(servers, auth, prompt)
        assert status == 200, answer
        texts.append(answer["choices"][0]["text"])
    return texts
