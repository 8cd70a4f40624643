"""TLS without a service mesh: the openai client talks to the router over HTTPS (a certificate from a CA made by
the test), the router talks to HTTPS workers it verifies with `--ca-cert-path` and authenticates to them with
`--worker-api-key` (not the client's key), and the api servers themselves serve HTTPS."""

from __future__ import annotations

import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from pd_harness import wait_pd_idle
from security_harness import MODEL, PROMPTS, WORKER_API_KEY

from decode_server.up import free_port

REPO = Path(__file__).resolve().parents[2]
CLIENT_API_KEY = "client-key-for-tests"


class Router:
    def __init__(self, servers: dict, material: dict, *extra: str) -> None:
        self.port = free_port("127.0.0.1")
        self.url = f"https://127.0.0.1:{self.port}"
        self.ctx = ssl.create_default_context(cafile=str(material["ca"]))
        prefill, decode = servers["prefill"], servers["decode"]
        args = [sys.executable, "-m", "decode_server.cli", "router", "--host", "127.0.0.1", "--port", str(self.port),
                "--prefill", prefill.url, str(prefill.bootstrap_port), "--decode", decode.url,
                "--health-check-interval-secs", "0.5", "--ssl-keyfile", str(material["key"]),
                "--ssl-certfile", str(material["cert"]), "--api-key", CLIENT_API_KEY, *extra]  # fmt: skip
        self.log = tempfile.NamedTemporaryFile("w+", prefix="router-tls-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)

    def log_text(self) -> str:
        return Path(self.log.name).read_text()

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", verify=self.ctx, timeout=5)

    def wait(self, healthy: bool = True, timeout: float = 60) -> Router:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_text()
            try:
                r = self.health()
                if not healthy or r.status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"router not ready:\n{self.log_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def router(servers, material) -> Iterator[Router]:
    r = Router(servers, material, "--worker-api-key", WORKER_API_KEY, "--ca-cert-path", str(material["ca"]),
               "--disaggregation-auth-secret-file", str(material["secret"]), "--router-processes", "2").wait()
    try:
        yield r
    finally:
        r.stop()
    assert r.proc.returncode == 0, r.log_text()


def test_openai_client_over_https_through_the_router(router, servers, reference):
    body = router.health().json()
    assert body["disaggregation_auth"] == "on"
    assert all(w["healthy"] for role in ("prefill", "decode") for w in body["workers"][role])
    with httpx.Client(verify=router.ctx) as http:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key=CLIENT_API_KEY, http_client=http, max_retries=0,
                               timeout=120)  # fmt: skip
        out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})  # fmt: skip
        assert out.choices[0].text == reference[0]
        pieces = [c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if c.choices]  # fmt: skip
        assert "".join(pieces) == reference[1]
        assert [m.id for m in client.models.list().data] == [MODEL]  # /v1/models: the worker key, over HTTPS
    for s in (servers["prefill"], servers["decode"]):
        wait_pd_idle(s, 30)


def test_clients_that_do_not_trust_the_certificate_or_speak_plain_http_get_nothing(router):
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=CLIENT_API_KEY, max_retries=0, timeout=10)
    with pytest.raises(openai.APIConnectionError):
        client.models.list()  # the system's CAs do not know the test CA
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{router.port}/health", timeout=5)


def test_workers_serve_https_and_take_only_the_worker_key(servers):
    """The router's requests above succeeded against these workers, which refuse the client's key: so the router
    sent its worker key. The api servers' own TLS: HTTPS answers, plain HTTP does not."""
    decode = servers["decode"]
    with decode.http(10) as c:
        assert c.get("/v1/models").status_code == 200
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {CLIENT_API_KEY}"}).status_code == 401
    with pytest.raises(httpx.HTTPError):
        httpx.get(decode.url.replace("https://", "http://") + "/health", timeout=5)


def test_router_refuses_workers_it_cannot_verify(servers, material):
    """Without the deployment's CA the router does not trust the workers' certificates: they never enter the
    rotation, and /health says why."""
    r = Router(servers, material, "--worker-api-key", WORKER_API_KEY, "--router-processes", "1").wait(healthy=False)
    try:
        time.sleep(1.5)
        resp = r.health()
        assert resp.status_code == 503
        errors = [w.get("last_error", "") for role in ("prefill", "decode") for w in resp.json()["workers"][role]]
        assert all("certificate" in e.lower() for e in errors), errors
    finally:
        r.stop()
