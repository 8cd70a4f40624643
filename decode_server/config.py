"""Configuration objects, one per concern, built from CLI flags (names follow SGLang where one exists)."""

from __future__ import annotations

import json
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class HiSparseConfig(BaseModel):
    """`--hisparse-config` JSON. Keys as in SGLang (`top_k`, `device_buffer_size`, `host_to_device_ratio`)
    plus ours."""

    model_config = ConfigDict(extra="forbid")

    top_k: int | None = Field(default=None, ge=1, description="tokens attended per step; default: index_topk")
    device_buffer_size: int | None = Field(
        default=None, ge=1, description="LRU device slots per request (D); default 2 * top_k; must be >= top_k"
    )
    host_to_device_ratio: float = Field(
        default=4.0, gt=0, description="host KV pool size relative to the device KV budget (when not explicit)"
    )
    num_recent_slots: int = Field(
        default=4, ge=1, description="device slots per request that keep its newest tokens (always hits)"
    )
    prefill_staging_tokens: int | None = Field(
        default=None, ge=0,
        description="rows of the device area colocated prefill attends over (two layers of it, out of the device "
                    "KV budget); default: the longest request plus a prefill chunk, at most 1/8 of the budget; "
                    "0: none (prefill gathers from the host pool, slower)",
    )
    prefetch_shared_layers: bool = Field(
        default=True,
        description="GLM-5 shared indexer layers: start their swap-ins (same top-k) at the full layer before them, "
                    "on a side stream, so their host copies overlap that layer's attention and MoE; outputs are "
                    "unchanged (measured on an H200 at 20 % misses: 6 % off glm5-shared-bench's step, 12 % off "
                    "glm5-rank-ep8's at 32K, docs/benchmarks.md)",
    )
    early_swap_in: bool = Field(
        default=False,
        description="decode: start each layer's swap-in on a side stream as soon as its indexer has selected, so "
                    "the query and KV-row projections run beside it instead of after it; outputs are unchanged. "
                    "Off by default: on an H100 it did not shorten the step (batch 1 and 17, 32K and 64K, "
                    "docs/benchmarks.md)",
    )
    speculative_prefetch: bool = Field(
        default=False,
        description="decode, DSA layers: once a layer has selected, swap its top-k into the next indexer layer's "
                    "buffer on a side stream, betting that layer selects many of the same tokens (adjacent layers' "
                    "top-k overlap 70-100 %, IndexCache), so the bet's copies overlap this layer's attention and "
                    "MoE; the next layer still swaps in its own selection, so outputs are unchanged. A wrong bet "
                    "costs PCIe bytes and buffer places. Off by default: see docs/benchmarks.md for when it pays; "
                    "on models with shared layers (GLM-5) /metrics' speculative_prefetch_rows_saved measures "
                    "what it saves on the served model (docs/engine.md)",
    )
    side_stream_copy_blocks: int | Literal["auto"] = Field(
        default="auto",
        description="cap on the copy kernel's thread blocks for swap-ins that run on a side stream (early_swap_in, "
                    "prefetch_shared_layers, speculative_prefetch), so they leave the other SMs to the kernels they "
                    "run beside (a capped grid keeps 4 rows a warp in flight); a block count, 0 for no cap (two "
                    "blocks an SM, one row a warp), or \"auto\": one block per 8 requests of the batch, 8 to 16 "
                    "(kernels/dispatch.py auto_copy_blocks); outputs are unchanged. On an H200 auto (8 blocks at "
                    "batch 42) took glm5-rank-ep8's 20 % miss step from 1.17-1.19x to 1.13-1.14x the 0 % step "
                    "against 16 blocks (docs/benchmarks.md)",
    )

    @field_validator("side_stream_copy_blocks")
    @classmethod
    def _copy_blocks_not_negative(cls, blocks: int | str) -> int | str:
        if isinstance(blocks, int) and blocks < 0:
            raise ValueError("side_stream_copy_blocks must be >= 0 (0: no cap) or \"auto\"")
        return blocks

    @classmethod
    def from_json(cls, text: str | None) -> HiSparseConfig:
        if not text:
            return cls()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--hisparse-config is not valid JSON: {exc}") from exc
        return cls.model_validate(data)


KVCacheDType = Literal["auto", "bfloat16", "float16", "float32", "fp8_e4m3"]
DisaggregationMode = Literal["null", "prefill", "decode"]


class DisaggregationConfig(BaseModel):
    """Prefill/decode disaggregation (`--disaggregation-*`, SGLang's names). `mode="null"` is colocated serving.

    A prefill server runs prompts and writes their KV into a decode server's memory; a decode server receives the
    KV of its requests from the prefill server named in each request (`bootstrap_host`, `bootstrap_port`). See
    docs/pd.md. Timeouts are in seconds, as SGLang's `SGLANG_DISAGGREGATION_*_TIMEOUT` variables are.
    """

    model_config = ConfigDict(extra="forbid")

    mode: DisaggregationMode = "null"
    bootstrap_port: int = Field(default=8998, ge=1, le=65535, description="prefill: its bootstrap HTTP server")
    transfer_backend: Literal["mooncake"] = "mooncake"
    ib_device: str | None = Field(default=None, description="RDMA device(s) for mooncake; TCP when unset")
    host: str = Field(default="127.0.0.1", description="address this server advertises to its peers (--host)")
    bootstrap_timeout_s: float = Field(
        default=300.0, gt=0, description="prefill: how long a request waits for its decode destination"
    )
    waiting_timeout_s: float = Field(
        default=300.0, gt=0, description="decode: how long a request waits for its KV after sending its destination"
    )
    transfer_timeout_s: float = Field(default=30.0, ge=5, description="one mooncake batch write (its minimum is 5 s)")
    heartbeat_interval_s: float = Field(default=5.0, gt=0, description="decode: health checks of each prefill peer")
    heartbeat_max_failures: int = Field(default=2, ge=1, description="missed heartbeats that fail a peer's rooms")
    auth_secret_file: str | None = Field(
        default=None, description="file holding the cluster secret that authenticates the PD control plane "
        "(bootstrap, control messages, the router's room tickets); None: unauthenticated (a loud warning)",
    )  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.mode != "null"


# Sparse MLA kernel on CUDA; "auto": FlashMLA on Hopper when its wheel imports, else Triton (SGLang's flag);
# "torch_native": the PyTorch reference attention / indexer kernels even on CUDA (any MLA / indexer size).
AttentionBackendName = Literal["auto", "flashmla", "triton", "torch_native"]


class EngineConfig(BaseModel):
    """Everything the engine process needs: model, device, memory budgets, scheduling limits."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = "tiny-dsa"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    kv_cache_dtype: KVCacheDType = "auto"
    # SGLang's --quantization: "fp8" keeps a block-FP8 checkpoint's weights in FP8 (FP8 GEMMs), "none" dequantizes
    # them at load; "auto" or None: what the checkpoint's quantization_config says (fp8 on CUDA, unless a
    # tensor-parallel piece cuts through a 128-block). CPU always dequantizes (decode_server/model/quantization.py).
    quantization: Literal["auto", "fp8", "none"] | None = None
    # SGLang's --disable-shared-experts-fusion: the shared expert stays its own GEMMs instead of one more expert of
    # the routed experts' grouped GEMMs (decode_server/model/moe.py; block-FP8 experts on a GPU whose table has it).
    disable_shared_experts_fusion: bool = False
    attention_backend: AttentionBackendName = "auto"
    # Batch-invariant mode: a request's tokens and logprobs do not depend on what else runs (docs/models.md).
    enable_deterministic_inference: bool = False
    # CUDA graphs of the decode step, one per batch-size bucket (SGLang's flags; docs/engine.md "CUDA graphs").
    # On by default on CUDA; graphs do not exist on CPU. None = the default buckets up to the default maximum.
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = Field(default=None, ge=1, description="largest batch a decode graph runs")
    cuda_graph_bs: list[int] | None = Field(default=None, min_length=1, description="batch sizes to capture")
    seed: int = 0

    enable_hisparse: bool = False
    hisparse: HiSparseConfig = Field(default_factory=HiSparseConfig)

    # Memory sizing. Explicit budgets win over the fraction.
    mem_fraction_static: float = Field(default=0.85, gt=0, le=1.0)
    device_kv_budget_bytes: int | None = Field(default=None, ge=0)
    host_kv_budget_bytes: int | None = Field(default=None, ge=0)
    page_size: int = Field(default=64, ge=1)

    # Scheduling.
    max_running_requests: int = Field(default=64, ge=1)
    max_queued_requests: int = Field(default=1024, ge=1)
    # SGLang's priority scheduling: waiting (and retracted) requests are taken in order of their `priority` (larger
    # first; with schedule_low_priority_values_first smaller first), then of arrival; retraction picks the lowest
    # priority first. Off: every request keeps its arrival order and a request's priority is ignored (as in SGLang),
    # or refused with abort_on_priority_when_disabled.
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    abort_on_priority_when_disabled: bool = False
    chunked_prefill_size: int = Field(default=2048, ge=1)
    # Prefix caching (vLLM's --enable-prefix-caching; SGLang's radix cache): finished requests' full KV pages stay
    # in a radix tree and a new prompt maps its cached prefix instead of recomputing it (docs/engine.md "Prefix
    # caching"). Off by default; a PD decode server receives every prompt's KV and refuses it.
    enable_prefix_caching: bool = False
    context_length: int | None = Field(default=None, ge=1)
    # Structured outputs (SGLang's --grammar-backend): response_format json_object / json_schema, regex and ebnf
    # constraints compiled by xgrammar (the `structured` extra); "none" refuses them. SGLang's
    # --constrained-json-disable-any-whitespace: JSON without optional whitespace (docs/engine.md "Structured outputs").
    grammar_backend: Literal["xgrammar", "none"] = "xgrammar"
    constrained_json_disable_any_whitespace: bool = False
    # Overlap scheduling (SGLang's --disable-overlap-schedule): the host prepares pass N+1 while the device runs
    # pass N. On by default on CUDA, off on CPU (nothing overlaps there); `force_overlap_schedule` runs it on CPU.
    disable_overlap_schedule: bool = False
    force_overlap_schedule: bool = False

    # SGLang's --watchdog-timeout: an engine step running longer than this ends the engine process (the server
    # then exits non-zero, so an orchestrator restarts it).
    watchdog_timeout: float = Field(default=300.0, gt=0)

    disaggregation: DisaggregationConfig = Field(default_factory=DisaggregationConfig)

    # Tensor parallelism (SGLang's --tp-size / --ep-size): one engine process per rank on one node; rank 0 talks to
    # the api and broadcasts its messages to the others every loop iteration (docs/parallelism.md "Runtime").
    tp_size: int = Field(default=1, ge=1, description="tensor-parallel ranks (one GPU each on CUDA)")
    ep_size: int = Field(default=1, ge=1, description="1: experts tensor-sharded; tp_size: experts split across ranks")
    # Data-parallel attention (SGLang's --enable-dp-attention / --dp-size): the tp_size ranks each run attention for
    # their own requests with their own KV and scheduler; MLPs, MoE and LM head stay sharded over all ranks, over
    # every rank's tokens gathered (docs/parallelism.md "Data-parallel attention"). dp_size must equal tp_size.
    enable_dp_attention: bool = False
    dp_size: int = Field(default=1, ge=1, description="attention data-parallel ranks (== tp_size with DP attention)")
    enable_dp_lm_head: bool = False  # DP attention: the LM head whole on every rank (no gather of sampled rows)
    # How the api spreads requests over DP ranks (SGLang's --load-balance-method): fewest requests in flight
    # (`shortest_queue`), fewest tokens (prompt + max_tokens) in flight (`minimum_tokens`), in turn, or to the rank
    # that cached the prompt's start (`cache_aware`, for --enable-prefix-caching; api/engine_client.py DPBalancer).
    load_balance_method: Literal["shortest_queue", "minimum_tokens", "round_robin", "cache_aware"] = "shortest_queue"

    @field_validator("model_path")
    @classmethod
    def _non_empty(cls, v: str) -> str:
        if not v:
            raise ValueError("model_path must not be empty")
        return v

    @field_validator("cuda_graph_bs")
    @classmethod
    def _positive_batch_sizes(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(b < 1 for b in v):
            raise ValueError(f"--cuda-graph-bs sizes must be >= 1, got {v}")
        return None if v is None else sorted(set(v))

    @model_validator(mode="after")
    def _check_hisparse(self) -> EngineConfig:
        hs = self.hisparse
        if hs.top_k is not None and hs.device_buffer_size is not None and hs.device_buffer_size < hs.top_k:
            raise ValueError(
                f"hisparse device_buffer_size ({hs.device_buffer_size}) must be >= top_k ({hs.top_k})"
            )
        if self.disaggregation.mode == "prefill" and self.enable_hisparse:
            raise ValueError(
                "--disaggregation-mode prefill keeps the prompt's KV dense on its device; drop --enable-hisparse "
                "(HiSparse is a decode-side mode)"
            )
        return self

    @model_validator(mode="after")
    def _check_prefix_caching(self) -> EngineConfig:
        if self.disaggregation.mode == "decode" and self.enable_prefix_caching:
            raise ValueError(
                "--enable-prefix-caching on a --disaggregation-mode decode server: its prompts' KV arrives whole from "
                "the prefill server, which is where prefix caching saves work (enable it there)"
            )
        return self

    @model_validator(mode="after")
    def _check_overlap(self) -> EngineConfig:
        if self.disable_overlap_schedule and self.force_overlap_schedule:
            raise ValueError("--disable-overlap-schedule and --force-overlap-schedule contradict each other")
        return self

    @model_validator(mode="after")
    def _check_parallel(self) -> EngineConfig:
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(
                f"--ep-size {self.ep_size} must be 1 (experts tensor-sharded) or equal to --tp-size {self.tp_size} "
                "(experts split across the tensor-parallel ranks)"
            )
        self._check_dp_attention()
        if self.enable_dp_attention and self.disaggregation.mode == "prefill":
            raise ValueError(
                "--enable-dp-attention with --disaggregation-mode prefill is not supported: a prefill server's ranks "
                "compute every prompt together (run it with --tp-size N alone; decode servers may use DP attention; "
                "docs/parallelism.md)"
            )
        return self

    def _check_dp_attention(self) -> None:
        if not self.enable_dp_attention:
            if self.dp_size > 1:
                raise ValueError(
                    f"--dp-size {self.dp_size} without --enable-dp-attention: independent data-parallel replicas "
                    "are separate servers here (put a router in front of them); --dp-size N with "
                    "--enable-dp-attention splits attention over the --tp-size ranks"
                )
            if self.enable_dp_lm_head:
                raise ValueError("--enable-dp-lm-head needs --enable-dp-attention")
            return
        if self.dp_size < 2:
            raise ValueError("--enable-dp-attention needs --dp-size N > 1 (and --tp-size N)")
        check_dp_size(self.tp_size, self.dp_size)

    @property
    def dp_attention_size(self) -> int:
        """Attention data-parallel ranks: dp_size with --enable-dp-attention, else 1."""
        return self.dp_size if self.enable_dp_attention else 1

    @property
    def attention_tp_size(self) -> int:
        """Ranks one request's attention heads are split over."""
        return self.tp_size // self.dp_attention_size


def check_dp_size(tp_size: int, dp_size: int) -> None:
    """DP attention is supported with one attention replica per rank (dp_size == tp_size) only."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if dp_size not in (1, tp_size):
        if tp_size % dp_size:
            raise ValueError(f"--dp-size {dp_size} must divide --tp-size {tp_size}")
        raise ValueError(
            f"--dp-size {dp_size} with --tp-size {tp_size} would split each attention replica over "
            f"{tp_size // dp_size} ranks (attention tensor parallelism inside a DP rank), which is not supported: "
            f"use --dp-size {tp_size} (one attention replica per rank) or plain tensor parallelism (--dp-size 1)"
        )


class ServerConfig(BaseModel):
    """The HTTP surface."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=30000, ge=0, le=65535)
    api_key: str | None = None
    served_model_name: str | None = None
    # SGLang's --chat-template: a Jinja file that replaces the checkpoint's chat template (checked at start-up).
    chat_template: str | None = None
    # SGLang's --reasoning-parser: chat responses split the model's thinking into `reasoning_content`
    # (decode_server/api/reasoning.py; None: the whole output is `content`).
    reasoning_parser: Literal["deepseek-r1", "deepseek-v3", "glm45"] | None = None
    # SGLang's --tool-call-parser: chat requests with `tools` get the calls the model wrote as `tool_calls`
    # (decode_server/api/tool_calls.py; None: requests with tools are refused).
    tool_call_parser: Literal["deepseekv32", "glm", "glm45", "glm47"] | None = None
    log_level: str = "info"
    # SGLang's --log-requests / --log-requests-level: a log line per request received and finished
    # (decode_server/api/request_log.py; 0 metadata, 1 + sampling parameters, 2 + texts cut short, 3 + whole texts).
    log_requests: bool = False
    log_requests_level: int = Field(default=0, ge=0, le=3)
    # Seconds without a heartbeat from the engine process before /health answers 503 and in-flight requests fail;
    # after `EngineConfig.watchdog_timeout` seconds of silence the api process kills the engine and exits.
    engine_heartbeat_timeout: float = Field(default=10.0, gt=0)
    # TLS for deployments without a service mesh (uvicorn's options): both files or neither.
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    # On SIGTERM/SIGINT: stop taking requests (/health 503, new requests 503) and let the ones in flight finish for
    # up to this many seconds before aborting them; 0 aborts them at once. Kubernetes' terminationGracePeriodSeconds
    # must be longer.
    graceful_shutdown_timeout: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _tls_pair(self) -> ServerConfig:
        check_tls_files(self.ssl_keyfile, self.ssl_certfile)
        return self


def check_tls_files(keyfile: str | None, certfile: str | None) -> None:
    """`--ssl-keyfile` and `--ssl-certfile` come together, and both must be readable files."""
    if bool(keyfile) != bool(certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile must be given together")
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile)):
        if path and not os.access(path, os.R_OK):
            raise ValueError(f"{flag} {path!r} is not a readable file")
