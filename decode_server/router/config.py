"""Router configuration: the worker lists and every knob of routing, health checks, retries and timeouts."""

from __future__ import annotations

import os
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's default `--disaggregation-bootstrap-port`
# How long a stopping router process waits: open streams (uvicorn's graceful timeout), then the aborts it sends.
GRACEFUL_SHUTDOWN_S = 5
ABORT_DRAIN_S = 3.0

Policy = Literal["round_robin", "random", "least_load", "cache_aware"]

MAX_DEFAULT_ROUTER_PROCESSES = 4


def default_router_processes() -> int:
    """min(4, the CPUs this process may run on): one router process is one core's worth of event loop (~1.3 ms
    of CPU per request, ~53 µs per relayed chunk), so a burst of 64 streams queues behind a single one; four
    processes cover that burst, while the cap keeps the N-fold health-check traffic and memory small on hosts
    whose other cores serve the model. The CPU affinity mask (not `os.cpu_count()`) is what a container or
    `taskset` grants."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_ROUTER_PROCESSES, cpus))


def normalize_url(url: str) -> str:
    """'127.0.0.1:30000' -> 'http://127.0.0.1:30000'; no trailing slash; only http(s) with a host and port."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not a worker URL: {url!r} (expected e.g. http://127.0.0.1:30000)")
    try:
        parts.port  # noqa: B018  (raises on a malformed port)
    except ValueError as exc:
        raise ValueError(f"not a worker URL: {url!r} ({exc})") from exc
    if parts.path not in ("", "/"):
        raise ValueError(f"worker URL {url!r} must not have a path (the router adds /v1/...)")
    return url


class PrefillWorkerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    bootstrap_port: int = Field(default=DEFAULT_BOOTSTRAP_PORT, ge=1, le=65535)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return normalize_url(v)

    @property
    def bootstrap_host(self) -> str:
        """The host decode contacts for the KV handshake: the host of the prefill URL (as SGLang's router)."""
        return urlsplit(self.url).hostname or ""


class DecodeWorkerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return normalize_url(v)


class RouterConfig(BaseModel):
    """`decode-server router` flags (SGLang router names where it has the flag)."""

    model_config = ConfigDict(extra="forbid")

    prefill: list[PrefillWorkerSpec] = Field(min_length=1)
    decode: list[DecodeWorkerSpec] = Field(min_length=1)
    policy: Policy = "round_robin"
    # SGLang's PD router flags: each role's policy, default `policy` (with cache_aware, decode takes round_robin:
    # decode servers receive every prompt's KV, so prefix affinity means nothing there).
    prefill_policy: Policy | None = None
    decode_policy: Policy | None = None
    # cache_aware (SGLang's names and defaults): the share of a prompt whose start a worker must have seen for the
    # prompt to follow it; the load gap (absolute and relative) beyond which the idlest worker is taken instead;
    # how many characters of prompt starts each router process remembers.
    cache_threshold: float = Field(default=0.5, ge=0, le=1)
    balance_abs_threshold: int = Field(default=32, ge=0)
    balance_rel_threshold: float = Field(default=1.0001, ge=1)
    max_tree_size: int = Field(default=2**24, ge=1)
    host: str = "127.0.0.1"
    port: int = Field(default=30000, ge=0, le=65535)
    api_key: str | None = None
    worker_api_key: str | None = Field(default=None, description="sent to every worker instead of the client's key")
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ca_cert_path: str | None = Field(default=None, description="CA (PEM) for https:// worker URLs")
    disaggregation_auth_secret_file: str | None = Field(
        default=None, description="the deployment's PD secret: the router signs the rooms it issues with it")
    request_timeout_secs: float = Field(default=1800.0, gt=0, description="whole request, both workers")
    connect_timeout_secs: float = Field(default=5.0, gt=0, description="TCP connect to a worker")
    health_check_interval_secs: float = Field(default=5.0, gt=0)
    health_check_timeout_secs: float = Field(default=5.0, gt=0)
    health_failure_threshold: int = Field(default=2, ge=1, description="failed checks before leaving rotation")
    health_success_threshold: int = Field(default=1, ge=1, description="passed checks before coming back")
    load_check_interval_secs: float = Field(default=1.0, gt=0, description="least_load: GET /load period")
    retry_max_retries: int = Field(default=2, ge=0, description="other pairs tried when one is unreachable")
    retry_backoff_ms: float = Field(default=50.0, ge=0, description="pause before each retry")
    log_level: str = "info"
    router_processes: int = Field(
        default_factory=default_router_processes, ge=1, le=256,
        description="router processes sharing the listening port (each with its own loop, pools and checks)",
    )  # fmt: skip

    @model_validator(mode="after")
    def _security_files(self) -> RouterConfig:
        from decode_server.config import check_tls_files

        check_tls_files(self.ssl_keyfile, self.ssl_certfile)
        if self.ca_cert_path and not os.access(self.ca_cert_path, os.R_OK):
            raise ValueError(f"--ca-cert-path {self.ca_cert_path!r} is not a readable file")
        return self

    @property
    def resolved_prefill_policy(self) -> str:
        return self.prefill_policy or self.policy

    @property
    def resolved_decode_policy(self) -> str:
        if self.decode_policy is not None:
            return self.decode_policy
        return "round_robin" if self.policy == "cache_aware" else self.policy

    @model_validator(mode="after")
    def _decode_not_cache_aware(self) -> RouterConfig:
        if self.decode_policy == "cache_aware":
            raise ValueError("--decode-policy cache_aware: decode servers receive every prompt's KV from prefill, so "
                             "prefix affinity does not apply there (use it for --prefill-policy or --policy)")
        return self

    @model_validator(mode="after")
    def _distinct(self) -> RouterConfig:
        for role, urls in (("prefill", [w.url for w in self.prefill]), ("decode", [w.url for w in self.decode])):
            if len(set(urls)) != len(urls):
                raise ValueError(f"a {role} worker URL is given twice: {urls}")
        return self
