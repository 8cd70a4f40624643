"""What the security tests share: a test CA and server certificate (made here, with `cryptography`), HTTPS
servers with a cluster secret (tests/disagg/pd_harness.py's servers over TLS), room tickets, raw control frames,
and an in-process rogue decode peer (a real `KVReceiver` over real mooncake TCP on 127.0.0.1)."""

from __future__ import annotations

import concurrent.futures
import datetime
import ipaddress
import itertools
import os
import secrets
import ssl
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "disagg"))

from api_server_harness import START_TIMEOUT_S, ServerProcess, child_pids, free_port  # noqa: E402
from pd_harness import FAST_TIMEOUTS, HISPARSE_CONFIG, SMALL_POOLS  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from transfer.auth import PDAuth  # noqa: E402

MODEL = "tiny-dsa"
WORKER_API_KEY = "worker-key-for-tests"
# Token-id prompts: one shorter than the HiSparse device buffer (64 rows), one longer.
PROMPTS = [[(11 * i + 7) % 900 + 5 for i in range(24)], [(13 * i + 3) % 900 + 5 for i in range(90)]]
# Rooms as the router draws them: 128 random bits (so they also exercise the 16-byte wire form and aux record).
_rooms = (secrets.randbits(128) for _ in itertools.count())


def next_room() -> int:
    return next(_rooms)


# ---- secrets and certificates ---------------------------------------------------------------------------------------


def write_secret(directory: Path, name: str) -> Path:
    path = directory / name
    path.write_text(os.urandom(32).hex() + "\n")
    path.chmod(0o600)
    return path


def make_test_pki(directory: Path) -> dict[str, Path]:
    """A CA and a certificate for 127.0.0.1 / localhost signed by it (PEM files): what a deployment without a mesh
    would get from its own CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hisparse test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])).issuer_name(ca_name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))  # fmt: skip
    paths = {"ca": directory / "ca.pem", "cert": directory / "server.pem", "key": directory / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))  # fmt: skip
    paths["key"].chmod(0o600)
    return paths


# ---- servers --------------------------------------------------------------------------------------------------------


class SecureServer(ServerProcess):
    """`decode-server serve` with a PD role, a cluster secret, an API key and (with `pki`) HTTPS."""

    def __init__(self, *extra: str, secret: Path | None, pki: dict[str, Path] | None,
                 api_key: str | None = WORKER_API_KEY) -> None:  # fmt: skip
        args = list(extra)
        if secret is not None:
            args += ["--disaggregation-auth-secret-file", str(secret)]
        if pki is not None:
            args += ["--ssl-keyfile", str(pki["key"]), "--ssl-certfile", str(pki["cert"])]
        super().__init__(*args, api_key=api_key)
        self.verify: Any = ssl.create_default_context(cafile=str(pki["ca"])) if pki is not None else True
        if pki is not None:
            self.url = self.url.replace("http://", "https://")
        self.info: dict = {}

    def http(self, timeout: float = 60) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, verify=self.verify, timeout=timeout)

    def wait_ready(self) -> SecureServer:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log_text()}")
            try:
                with self.http(10) as c:
                    if c.get("/health").status_code == 200:
                        self.info = c.get("/server_info").json()
                        self.engine_pid = self.info["engine_pid"]
                        self.children = child_pids(self.proc.pid)
                        return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"server not ready after {START_TIMEOUT_S} s:\n{self.log_text()}")

    def stats(self) -> dict:
        with self.http(10) as c:
            return c.get("/server_info").json()["stats"]

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples `name` whose labels include `labels`."""
        with self.http(10) as c:
            text = c.get("/metrics").text
        return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))  # fmt: skip

    def rejected(self, reason: str) -> float:
        return self.metric("sglang:kv_transfer_rejected_messages_total", reason=reason)

    @property
    def control_endpoint(self) -> str:
        return self.info["engine"]["disaggregation"]["control_endpoint"]


class SecurePrefill(SecureServer):
    def __init__(self, *extra: str, secret: Path | None, pki: dict[str, Path] | None) -> None:
        self.bootstrap_port = free_port()
        super().__init__("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                         str(self.bootstrap_port), *SMALL_POOLS, *FAST_TIMEOUTS, *extra, secret=secret, pki=pki)


def secure_decode(*extra: str, secret: Path | None, pki: dict[str, Path] | None) -> SecureServer:
    return SecureServer("--disaggregation-mode", "decode", "--enable-hisparse", "--hisparse-config", HISPARSE_CONFIG,
                        *SMALL_POOLS, *FAST_TIMEOUTS, "--disaggregation-waiting-timeout", "60", *extra,
                        secret=secret, pki=pki)  # fmt: skip


def pd_fields(prefill: SecurePrefill, room: int, auth: PDAuth | None) -> dict[str, Any]:
    """The bootstrap fields a router adds, with its ticket when it holds the secret (`auth`)."""
    fields: dict[str, Any] = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
                              "bootstrap_room": room}
    if auth is not None:
        fields["bootstrap_auth"] = auth.sign_ticket("127.0.0.1", prefill.bootstrap_port, room)
    return fields


def completion_body(prompt: list[int], fields: dict[str, Any], max_tokens: int = 6) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **fields}


# ---- raw control frames ------------------------------------------------------------------------------------------


class RawPusher:
    """PUSH sockets to arbitrary control endpoints: frames exactly as given (forged, replayed, garbage)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.socks: dict[str, zmq.Socket] = {}

    def send(self, endpoint: str, frame: bytes) -> None:
        sock = self.socks.get(endpoint)
        if sock is None:
            sock = self.socks[endpoint] = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
        sock.send(frame)

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close(0)
        self.ctx.term()


# ---- a rogue decode peer -----------------------------------------------------------------------------------------


class RogueDecode:
    """A decode receiver outside the deployment (no secret, or another one): real KVReceiver, real mooncake over
    TCP, zeroed destination memory shaped like the real decode server's layout. Whatever reaches its memory
    shows up as non-zero bytes."""

    def __init__(self, layout: dict[str, Any], auth: PDAuth | None, rows: int = 512) -> None:
        from transfer.layout import TransferLayout
        from transfer.mooncake_transport import MooncakeTransport
        from transfer.receiver import KVReceiver, ReceiverTimeouts
        from transfer.regions import MemoryRegion

        self.layout = TransferLayout.from_dict(layout)
        self.transport = MooncakeTransport("127.0.0.1", "tcp", transfer_timeout_s=5)
        self.arrays = {name: np.zeros((self.layout.num_layers, rows, row_bytes), dtype=np.uint8)
                       for name, row_bytes in self.layout.regions.items()}  # fmt: skip
        self.aux = np.zeros((1, 8, self.layout.aux_bytes), dtype=np.uint8)
        self.receiver = KVReceiver(
            self.transport, self.layout, [MemoryRegion.from_array(n, a) for n, a in self.arrays.items()],
            MemoryRegion.from_array("aux", self.aux), ReceiverTimeouts(bootstrap_s=10, waiting_s=10),
            zmq_host="127.0.0.1", auth=auth,
        )  # fmt: skip

    def regions_description(self) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
        return {n: r.describe() for n, r in self.receiver.regions.items()}, self.receiver.aux.describe()

    def wait(self, room: int, timeout: float = 20.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for result in self.receiver.poll():
                if result.room == room:
                    return result
            time.sleep(0.01)
        raise AssertionError(f"the rogue's room {room} did not end within {timeout} s")

    def untouched(self) -> bool:
        return not any(a.any() for a in self.arrays.values()) and not self.aux.any()

    def close(self) -> None:
        self.receiver.close()
        self.transport.close()


# ---- requests ------------------------------------------------------------------------------------------------------


def pd_request(servers: dict[str, SecureServer], auth: PDAuth, prompt: list[int], room: int | None = None,
               timeout: float = 120) -> tuple[int, dict]:  # fmt: skip
    """What a router does, from this thread: the same ticketed body to prefill and decode at once; decode's
    (status, JSON)."""
    prefill, decode = servers["prefill"], servers["decode"]
    body = completion_body(prompt, pd_fields(prefill, next_room() if room is None else room, auth))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(post_json, s, body, timeout) for s in (prefill, decode)]
        (_, _), (status, answer) = (f.result() for f in futures)
    return status, answer


def post_json(server: SecureServer, body: dict, timeout: float) -> tuple[int, dict]:
    with server.http(timeout) as c:
        r = c.post("/v1/completions", json=body)
        return r.status_code, r.json()
