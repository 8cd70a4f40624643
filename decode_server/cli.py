"""`decode-server`: `serve` (the OpenAI-compatible HTTP service), `generate` (offline, in this process),
`router` (the PD router in front of prefill and decode servers), `up` (a whole local PD deployment) and `plan`
(the memory planner: weights, KV budget and batch sizes per GPU from a config.json).

Imports of the engine, the HTTP server and the router happen inside the subcommands, so that `router` and `up`
start without torch.

Flag names follow SGLang's `launch_server` where SGLang has the flag (`--model-path`, `--enable-hisparse`,
`--hisparse-config`, `--kv-cache-dtype`, `--mem-fraction-static`, `--max-running-requests`,
`--chunked-prefill-size`, `--api-key`, `--served-model-name`, ...). They map one to one onto `EngineConfig`
and `ServerConfig`, whose validation errors are reported as usage errors (exit code 2).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args

from pydantic import ValidationError

from decode_server.config import DisaggregationConfig, EngineConfig, HiSparseConfig, ServerConfig

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}  # fmt: skip


def parse_bytes(text: str) -> int:
    """'1073741824', '512MiB', '2GiB', '1.5GB' -> bytes."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB, 1073741824)")
    unit = (match.group(2) or "").lower().removesuffix("b")
    return int(float(match.group(1)) * _UNITS[unit])


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = p.add_argument_group("model and engine")
    g.add_argument(
        "--model-path",
        default=d.model_path,
        help="'tiny-dsa' (embedded default, generated on first use) or a checkpoint directory",
    )
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default=d.device)
    g.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default=d.dtype)
    g.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "bfloat16", "float16", "float32", "fp8_e4m3"],
        default=d.kv_cache_dtype,
    )
    g.add_argument(
        "--quantization",
        choices=["auto", "fp8", "none"],
        default=None,
        help="weights of a block-FP8 checkpoint: fp8 keeps them in FP8 on the GPU (block-FP8 GEMMs), none "
        "dequantizes them to --dtype at load, auto (the default) follows the checkpoint's quantization_config "
        "(FP8 on CUDA unless a tensor-parallel piece cuts through a 128-block); the CPU always dequantizes",
    )
    g.add_argument(
        "--disable-shared-experts-fusion",
        action="store_true",
        help="keep the MoE's shared expert as its own GEMMs; by default, with block-FP8 experts on a GPU whose FP8 "
        "table has the shapes and without expert parallelism, it runs as one more expert of the routed experts' "
        "grouped GEMMs",
    )
    g.add_argument(
        "--attention-backend",
        choices=["auto", "flashmla", "triton", "torch_native"],
        default=d.attention_backend,
        help="sparse MLA kernel on CUDA (auto: flashmla on Hopper when installed, else triton); torch_native: the "
        "PyTorch reference kernels on any device (MLA / indexer sizes the GPU kernels refuse)",
    )
    g.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="batch-invariant kernels and fixed prefill chunks: a request's output does not depend on its batch",
    )
    g.add_argument(
        "--disable-cuda-graph", action="store_true",
        help="run every decode step eagerly (CUDA graphs of the decode step are on by default on CUDA)",
    )
    g.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="largest decode batch run by a CUDA graph (default: min(--max-running-requests, 256))")
    g.add_argument("--cuda-graph-bs", type=int, nargs="+", default=None, metavar="N",
                   help="decode batch sizes to capture (default: 1 2 4 8 12 16 24 ... up to --cuda-graph-max-bs)")
    g.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="read each pass's tokens before scheduling the next (overlap is on by default on CUDA, off on CPU)",
    )
    g.add_argument(
        "--force-overlap-schedule",
        action="store_true",
        help="overlap scheduling even on CPU, where it cannot help (tests of its code path)",
    )
    g.add_argument("--random-seed", type=int, default=d.seed, help="seed of requests that give none")
    g.add_argument("--context-length", type=int, default=None, help="cap on prompt + generated tokens")
    g.add_argument(
        "--enable-hisparse",
        action="store_true",
        help="keep every request's KV in pinned host memory; only a per-request buffer on the device",
    )
    g.add_argument(
        "--hisparse-config",
        default=None,
        metavar="JSON",
        help='e.g. \'{"top_k": 64, "device_buffer_size": 128, "host_to_device_ratio": 4}\'',
    )
    g.add_argument(
        "--mem-fraction-static",
        type=float,
        default=d.mem_fraction_static,
        help="fraction of GPU memory for weights + KV (CUDA)",
    )
    g.add_argument(
        "--device-kv-budget",
        type=parse_bytes,
        default=None,
        metavar="SIZE",
        help="explicit device KV budget (wins over --mem-fraction-static), e.g. 4GiB",
    )
    g.add_argument(
        "--host-kv-budget",
        type=parse_bytes,
        default=None,
        metavar="SIZE",
        help="explicit host KV pool size for HiSparse, e.g. 32GiB",
    )
    g.add_argument("--page-size", type=int, default=d.page_size)
    g.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=d.max_queued_requests,
        help="bound of the waiting queue; beyond it requests get 503 + Retry-After",
    )
    g.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size)  # fmt: skip
    g.add_argument("--enable-priority-scheduling", action="store_true",
                   help="take waiting requests in order of their `priority` field (larger first), then arrival")
    g.add_argument("--schedule-low-priority-values-first", action="store_true",
                   help="with --enable-priority-scheduling: smaller `priority` values first")
    g.add_argument("--abort-on-priority-when-disabled", action="store_true",
                   help="without --enable-priority-scheduling, refuse a request that gives a priority (default: "
                        "ignore it)")
    g.add_argument(
        "--grammar-backend", choices=["xgrammar", "none"], default=d.grammar_backend,
        help="what compiles response_format json_object / json_schema, regex and ebnf constraints (xgrammar, the "
        "`structured` extra); none: refuse them",
    )
    g.add_argument(
        "--constrained-json-disable-any-whitespace", action="store_true",
        help="constrained JSON without optional whitespace (the model cannot pad it with spaces or newlines)",
    )
    g.add_argument(
        "--enable-prefix-caching", action="store_true",
        help="keep finished requests' KV pages in a radix tree and map a new prompt's cached prefix instead of "
        "recomputing it (colocated and prefill servers; off by default)",
    )
    g.add_argument(
        "--disable-radix-cache", action="store_true",
        help="SGLang's flag: prefix caching off, which is the default here (accepted so SGLang launch lines work)",
    )
    g.add_argument(
        "--tp-size", "--tp", dest="tp_size", type=int, default=d.tp_size,
        help="tensor-parallel ranks: one engine process per rank (one GPU each on CUDA, gloo on CPU)",
    )
    g.add_argument(
        "--ep-size", type=int, default=d.ep_size,
        help="expert parallelism: 1 (experts tensor-sharded) or --tp-size (experts split across the ranks)",
    )
    g.add_argument(
        "--enable-dp-attention", action="store_true",
        help="data-parallel attention: each of the --tp-size ranks runs attention for its own requests with its own "
        "KV (N ranks hold N GPUs' worth of KV); dense layers, MoE and LM head stay sharded over all ranks "
        "(docs/parallelism.md)",
    )
    g.add_argument(
        "--dp-size", "--dp", dest="dp_size", type=int, default=d.dp_size,
        help="attention data-parallel ranks with --enable-dp-attention; must equal --tp-size",
    )
    g.add_argument(
        "--enable-dp-lm-head", action="store_true",
        help="with --enable-dp-attention: the LM head whole on every rank (no gather of the sampled rows, "
        "vocab × hidden more weight memory per rank)",
    )
    g.add_argument(
        "--load-balance-method", choices=["shortest_queue", "minimum_tokens", "round_robin", "cache_aware"],
        default=d.load_balance_method,
        help="with --enable-dp-attention: how requests are spread over the ranks (fewest requests in flight, "
        "fewest prompt + max_tokens in flight, in turn, or to the rank that cached the prompt's start: cache_aware, "
        "with --enable-prefix-caching)",
    )
    g.add_argument(
        "--watchdog-timeout",
        type=float,
        default=d.watchdog_timeout,
        help="seconds: an engine step (or engine silence) longer than this ends the engine and the server",
    )


def _add_disaggregation_args(p: argparse.ArgumentParser) -> None:
    d = DisaggregationConfig()
    g = p.add_argument_group("prefill/decode disaggregation (docs/pd.md)")
    g.add_argument(
        "--disaggregation-mode", choices=["null", "prefill", "decode"], default=d.mode,
        help="null: prefill and decode here (colocated); prefill: run prompts and send their KV to a decode "
        "server; decode: receive each request's KV from the prefill server named in the request",
    )
    g.add_argument("--disaggregation-bootstrap-port", type=int, default=d.bootstrap_port,
                   help="prefill: port of the bootstrap server (on --host) that decode servers look it up on")
    g.add_argument("--disaggregation-transfer-backend", choices=["mooncake"], default=d.transfer_backend)
    g.add_argument("--disaggregation-ib-device", default=None,
                   help="RDMA device(s) for the transfer engine, e.g. mlx5_0; TCP when unset")
    g.add_argument("--disaggregation-bootstrap-timeout", type=float, default=d.bootstrap_timeout_s,
                   metavar="SECONDS", help="prefill: a request fails if decode sends no destination in time")
    g.add_argument("--disaggregation-waiting-timeout", type=float, default=d.waiting_timeout_s,
                   metavar="SECONDS", help="decode: a request fails if its KV has not arrived in time")
    g.add_argument("--disaggregation-transfer-timeout", type=float, default=d.transfer_timeout_s,
                   metavar="SECONDS", help="one transfer-engine batch write (mooncake's MC_TRANSFER_TIMEOUT, >= 5)")
    g.add_argument("--disaggregation-heartbeat-interval", type=float, default=d.heartbeat_interval_s,
                   metavar="SECONDS", help="decode: health checks of each prefill peer's bootstrap server")
    g.add_argument("--disaggregation-heartbeat-max-failures", type=int, default=d.heartbeat_max_failures,
                   help="decode: missed heartbeats after which a prefill peer's requests fail")
    _add_auth_secret_arg(g)


def _add_auth_secret_arg(g: Any) -> None:
    from transfer.auth import SECRET_FILE_ENV

    g.add_argument("--disaggregation-auth-secret-file", default=os.environ.get(SECRET_FILE_ENV) or None,
                   metavar="PATH",
                   help="file holding the deployment's shared secret (at least 32 bytes, e.g. `openssl rand -hex 32`): "
                   "authenticates the PD control plane (bootstrap, control messages, the router's room tickets); "
                   f"default ${SECRET_FILE_ENV}; unset: unauthenticated, with a warning (docs/pd.md)")


def _add_tls_args(g: Any) -> None:
    g.add_argument("--ssl-keyfile", default=None, metavar="PATH", help="serve HTTPS: the TLS private key (PEM)")
    g.add_argument("--ssl-certfile", default=None, metavar="PATH", help="serve HTTPS: the TLS certificate chain (PEM)")


def disaggregation_config_from_args(args: argparse.Namespace) -> DisaggregationConfig:
    if not hasattr(args, "disaggregation_mode"):
        return DisaggregationConfig()
    return DisaggregationConfig(
        mode=args.disaggregation_mode,
        bootstrap_port=args.disaggregation_bootstrap_port,
        transfer_backend=args.disaggregation_transfer_backend,
        ib_device=args.disaggregation_ib_device,
        host=args.host,
        bootstrap_timeout_s=args.disaggregation_bootstrap_timeout,
        waiting_timeout_s=args.disaggregation_waiting_timeout,
        transfer_timeout_s=args.disaggregation_transfer_timeout,
        heartbeat_interval_s=args.disaggregation_heartbeat_interval,
        heartbeat_max_failures=args.disaggregation_heartbeat_max_failures,
        auth_secret_file=args.disaggregation_auth_secret_file,
    )


def prefix_caching_from_args(args: argparse.Namespace) -> bool:
    if args.enable_prefix_caching and args.disable_radix_cache:
        raise ValueError("--enable-prefix-caching and --disable-radix-cache contradict each other")
    return bool(args.enable_prefix_caching)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        disaggregation=disaggregation_config_from_args(args),
        model_path=args.model_path,
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        disable_shared_experts_fusion=args.disable_shared_experts_fusion,
        attention_backend=args.attention_backend,
        enable_deterministic_inference=args.enable_deterministic_inference,
        disable_cuda_graph=args.disable_cuda_graph,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        cuda_graph_bs=args.cuda_graph_bs,
        seed=args.random_seed,
        disable_overlap_schedule=args.disable_overlap_schedule,
        force_overlap_schedule=args.force_overlap_schedule,
        context_length=args.context_length,
        enable_hisparse=args.enable_hisparse,
        hisparse=HiSparseConfig.from_json(args.hisparse_config),
        mem_fraction_static=args.mem_fraction_static,
        device_kv_budget_bytes=args.device_kv_budget,
        host_kv_budget_bytes=args.host_kv_budget,
        page_size=args.page_size,
        max_running_requests=args.max_running_requests,
        max_queued_requests=args.max_queued_requests,
        enable_priority_scheduling=args.enable_priority_scheduling,
        schedule_low_priority_values_first=args.schedule_low_priority_values_first,
        abort_on_priority_when_disabled=args.abort_on_priority_when_disabled,
        chunked_prefill_size=args.chunked_prefill_size,
        enable_prefix_caching=prefix_caching_from_args(args),
        grammar_backend=args.grammar_backend,
        constrained_json_disable_any_whitespace=args.constrained_json_disable_any_whitespace,
        watchdog_timeout=args.watchdog_timeout,
        tp_size=args.tp_size,
        ep_size=args.ep_size,
        enable_dp_attention=args.enable_dp_attention,
        dp_size=args.dp_size,
        enable_dp_lm_head=args.enable_dp_lm_head,
        load_balance_method=args.load_balance_method,
    )


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        chat_template=args.chat_template,
        log_level=args.log_level,
        log_requests=args.log_requests,
        log_requests_level=args.log_requests_level,
        engine_heartbeat_timeout=args.engine_heartbeat_timeout,
        graceful_shutdown_timeout=args.graceful_shutdown_timeout,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="decode-server", description="HiSparse decode server for DeepSeek-V3.2-style (DSA) models"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _add_engine_args(serve)
    s = ServerConfig()
    g = serve.add_argument_group("HTTP server")
    g.add_argument("--host", default=s.host)
    g.add_argument("--port", type=int, default=s.port)
    g.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer <key>' (not on /health*, /metrics)"
    )
    g.add_argument("--served-model-name", default=None, help="model id in the API (default: --model-path)")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file that replaces the checkpoint's (e.g. one that renders tools)")
    g.add_argument("--tool-call-parser", default=None, choices=["deepseekv32", "glm", "glm45", "glm47"],
                   help="parse the function calls the model writes into tool_calls (deepseekv32: DeepSeek-V3.2's "
                        "DSML; glm, or SGLang's names glm45 / glm47: GLM-4.5 and later, GLM-5); without it, requests "
                        "with tools are refused")
    g.add_argument("--reasoning-parser", default=None, choices=["deepseek-r1", "deepseek-v3", "glm45"],
                   help="split a reasoning model's thinking into the chat responses' reasoning_content (deepseek-v3: "
                        "when a request sets chat_template_kwargs {\"thinking\": true}; docs/server.md)")
    g.add_argument("--log-level", default=s.log_level, choices=["debug", "info", "warning", "error"])
    g.add_argument("--log-requests", action="store_true",
                   help="log each generation request when it arrives and when it ends (off: prompts are user data)")
    g.add_argument("--log-requests-level", type=int, default=s.log_requests_level, choices=[0, 1, 2, 3],
                   help="0: ids, token counts, finish reasons; 1: + sampling parameters; 2: + prompt and output "
                        "text cut to 2048 characters; 3: + whole texts")
    g.add_argument(
        "--engine-heartbeat-timeout",
        type=float,
        default=s.engine_heartbeat_timeout,
        help="seconds without an engine heartbeat before /health answers 503 and in-flight requests fail",
    )
    g.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=s.graceful_shutdown_timeout,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT stop accepting requests (/health 503) and let those in flight finish for up to "
        "this long before aborting them (0: abort at once); a second signal stops at once",
    )
    _add_tls_args(g)
    _add_disaggregation_args(serve)

    gen = sub.add_parser("generate", help="generate offline, in this process (no server)")
    _add_engine_args(gen)
    g = gen.add_argument_group("generation")
    g.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--min-tokens", type=int, default=0, help="EOS, stop ids and stop strings wait for this many")
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--logit-bias", action="append", default=None, metavar="ID=BIAS",
                   help="add BIAS to token ID's logit (repeatable)")
    constraint = g.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", default=None, metavar="SCHEMA",
                            help="the output is JSON valid against this schema (JSON text, or @file)")
    constraint.add_argument("--regex", default=None, help="the output matches this regular expression")
    constraint.add_argument("--ebnf", default=None, help="the output matches this EBNF grammar (rule `root`)")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    g.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])

    plan = sub.add_parser(
        "plan", help="memory per GPU and the largest batch, dense and HiSparse, from a config.json (no weights)",
        description="Plan one GPU of a deployment before renting it: weight bytes (FP8 as stored), KV bytes per "
        "token, the KV budget --mem-fraction-static leaves, and how many requests of --context-length fit, dense "
        "and HiSparse. Reads config.json (and a checkpoint's safetensors headers, never a tensor); the flags are "
        "serve's. docs/deploy.md 'Planning memory'.",
    )
    _add_plan_args(plan)

    router = sub.add_parser("router", help="run the PD router in front of prefill and decode servers")
    _add_router_args(router)

    from decode_server.up import add_up_args

    up = sub.add_parser("up", help="start a local PD deployment: prefill + decode servers and a router")
    add_up_args(up)
    return parser


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = p.add_argument_group("model and deployment")
    g.add_argument("--model-path", default=d.model_path,
                   help="a config in configs/ (tiny-dsa, deepseek-v3.2, glm-5, dsv32-bench, ...), a config.json, or "
                        "a checkpoint directory (its config.json, and its safetensors headers for which projections "
                        "are FP8; no tensor is read)")
    g.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: FP8 weights as stored, bf16 otherwise; cpu: weights dequantized to float32")
    g.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default=d.dtype)
    g.add_argument("--quantization", choices=["auto", "fp8", "none"], default="auto",
                   help="serve's: auto (the default) keeps a block-FP8 checkpoint's projections in FP8 on CUDA "
                        "unless a tensor-parallel piece cuts through a 128-block; fp8 insists; none dequantizes; "
                        "the CPU always dequantizes")
    g.add_argument("--kv-cache-dtype", choices=["auto", "bfloat16", "float16", "float32", "fp8_e4m3"],
                   default=d.kv_cache_dtype)
    g.add_argument("--attention-backend", choices=["auto", "flashmla", "triton", "torch_native"],
                   default=d.attention_backend, help="only checked: whether the GPU kernels run this model")
    g.add_argument("--tp-size", "--tp", dest="tp_size", type=int, default=d.tp_size)
    g.add_argument("--ep-size", type=int, default=d.ep_size)
    g.add_argument("--enable-dp-attention", action="store_true",
                   help="plan data-parallel attention (each rank its own requests and KV); with --tp-size > 1 the "
                        "plan reports both attention layouts' requests per node either way")
    g.add_argument("--dp-size", "--dp", dest="dp_size", type=int, default=d.dp_size,
                   help="attention data-parallel ranks with --enable-dp-attention; must equal --tp-size")
    g = p.add_argument_group("memory")
    g.add_argument("--device-memory", type=_device_memory, default=None, metavar="SIZE|H100|H200",
                   help="total memory of one GPU as nvidia-smi reports it (H100: 81559MiB, H200: 143771MiB)")
    g.add_argument("--mem-fraction-static", type=float, default=d.mem_fraction_static)
    g.add_argument("--runtime-memory", type=parse_bytes, default=None, metavar="SIZE",
                   help="device memory in use besides the weights when the engine sizes its KV (CUDA context, "
                        "allocator rounding); default 1GiB, an estimate: the server logs the real figure")
    g.add_argument("--device-kv-budget", type=parse_bytes, default=None, metavar="SIZE",
                   help="explicit device KV budget (wins over --mem-fraction-static)")
    g.add_argument("--host-kv-budget", type=parse_bytes, default=None, metavar="SIZE",
                   help="explicit HiSparse host pool (default: host_to_device_ratio × the device KV budget)")
    g.add_argument("--host-memory", type=parse_bytes, default=None, metavar="SIZE",
                   help="available memory of the serving host: a derived host pool is capped at half of it")
    g = p.add_argument_group("scheduling")
    g.add_argument("--context-length", type=int, default=None,
                   help="tokens per request (prompt + output) the batch sizes are for (default: the model's)")
    g.add_argument("--page-size", type=int, default=d.page_size)
    g.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    g.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size)
    g.add_argument("--enable-hisparse", action="store_true",
                   help="accepted for serve's command line; both modes are always planned")
    g.add_argument("--hisparse-config", default=None, metavar="JSON")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def _device_memory(text: str) -> int:
    """`--device-memory`: `H100` / `H200` (their totals, decode_server/planner.py `GPU_MEMORY`) or a size."""
    from decode_server.planner import GPU_MEMORY

    try:
        return GPU_MEMORY.get(text.strip().lower()) or parse_bytes(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"not a size or a GPU name (H100, H200): {text!r}") from None


def _cmd_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from decode_server.planner import (
        DEFAULT_RUNTIME_MEMORY,
        checkpoint_dir,
        format_plan,
        make_plan,
        read_config_json,
    )

    try:
        engine = EngineConfig(
            model_path=args.model_path, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
            attention_backend=args.attention_backend, tp_size=args.tp_size, ep_size=args.ep_size,
            enable_dp_attention=args.enable_dp_attention, dp_size=args.dp_size, mem_fraction_static=args.mem_fraction_static, device_kv_budget_bytes=args.device_kv_budget,
            host_kv_budget_bytes=args.host_kv_budget, context_length=args.context_length, page_size=args.page_size,
            max_running_requests=args.max_running_requests, chunked_prefill_size=args.chunked_prefill_size,
            enable_hisparse=args.enable_hisparse, hisparse=HiSparseConfig.from_json(args.hisparse_config),
            quantization=args.quantization,
        )
        raw, config_path = read_config_json(args.model_path)
        plan = make_plan(raw, engine, model_name=args.model_path,
                         device_memory=args.device_memory, checkpoint=checkpoint_dir(config_path),
                         runtime_memory=args.runtime_memory if args.runtime_memory is not None
                         else DEFAULT_RUNTIME_MEMORY,
                         host_memory=args.host_memory)
    except (ValidationError, ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    print(json.dumps(plan.to_json(), indent=2) if args.json else format_plan(plan))
    return 0


def _add_router_args(p: argparse.ArgumentParser) -> None:
    from decode_server.router.config import DEFAULT_BOOTSTRAP_PORT, Policy, RouterConfig

    d = RouterConfig.model_construct()
    g = p.add_argument_group("workers")
    g.add_argument("--prefill", nargs="+", action="append", required=True, metavar=("URL", "BOOTSTRAP_PORT"),
                   help=f"a prefill server and its bootstrap port (default {DEFAULT_BOOTSTRAP_PORT}); repeatable")  # fmt: skip
    g.add_argument("--decode", action="append", required=True, metavar="URL", help="a decode server; repeatable")
    g = p.add_argument_group("routing")
    policies = list(get_args(Policy))
    g.add_argument("--policy", choices=policies, default=d.policy,
                   help="both roles' policy; cache_aware: prefill by prompt-prefix affinity (for prefill servers with "
                   "--enable-prefix-caching), decode round_robin")
    g.add_argument("--prefill-policy", choices=policies, default=None, help="prefill's policy (default: --policy)")
    g.add_argument("--decode-policy", choices=[p for p in policies if p != "cache_aware"], default=None,
                   help="decode's policy (default: --policy; round_robin when that is cache_aware)")
    g.add_argument("--cache-threshold", type=float, default=d.cache_threshold,
                   help="cache_aware: share of a prompt a worker must have seen the start of to get it")
    g.add_argument("--balance-abs-threshold", type=int, default=d.balance_abs_threshold,
                   help="cache_aware: in-flight gap above which the idlest worker gets every request ...")
    g.add_argument("--balance-rel-threshold", type=float, default=d.balance_rel_threshold,
                   help="... when the busiest also has more than this times the idlest's count")
    g.add_argument("--max-tree-size", type=int, default=d.max_tree_size,
                   help="cache_aware: characters of prompt starts each router process remembers")
    g.add_argument("--host", default=d.host)
    g.add_argument("--port", type=int, default=d.port)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' (not on /health, /metrics)")
    _add_tls_args(g)
    g = p.add_argument_group("workers' security")
    g.add_argument("--worker-api-key", default=None,
                   help="sent as 'Authorization: Bearer <key>' on every request to a worker (their --api-key), "
                   "instead of the client's own credentials")
    g.add_argument("--ca-cert-path", default=None, metavar="PATH",
                   help="CA certificate(s) (PEM) that https:// worker URLs are verified with (default: the system's)")
    _add_auth_secret_arg(g)
    g = p.add_argument_group("routing")
    g.add_argument("--request-timeout-secs", type=float, default=d.request_timeout_secs,
                   help="longest wait for decode's answer, and for each chunk of a stream")  # fmt: skip
    g.add_argument("--connect-timeout-secs", type=float, default=d.connect_timeout_secs)
    g.add_argument("--health-check-interval-secs", type=float, default=d.health_check_interval_secs)
    g.add_argument("--health-check-timeout-secs", type=float, default=d.health_check_timeout_secs)
    g.add_argument("--health-failure-threshold", type=int, default=d.health_failure_threshold,
                   help="failed checks in a row before a worker leaves the rotation")  # fmt: skip
    g.add_argument("--health-success-threshold", type=int, default=d.health_success_threshold,
                   help="passed checks in a row before it comes back")  # fmt: skip
    g.add_argument("--load-check-interval-secs", type=float, default=d.load_check_interval_secs,
                   help="least_load: how often each worker's GET /load is read")  # fmt: skip
    g.add_argument("--retry-max-retries", type=int, default=d.retry_max_retries,
                   help="other pairs tried when a worker is unreachable before the first byte")  # fmt: skip
    g.add_argument("--retry-backoff-ms", type=float, default=d.retry_backoff_ms)
    g.add_argument("--router-processes", type=int, default=d.router_processes, metavar="N",
                   help="router processes sharing the port (SO_REUSEPORT), each with its own event loop, pools and "
                        "health checks; default min(4, CPUs available), here %(default)s")  # fmt: skip
    g.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])


def router_config_from_args(args: argparse.Namespace) -> Any:
    from decode_server.router.config import RouterConfig

    prefill = []
    for values in args.prefill:
        if len(values) > 2:
            raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(values)}")
        spec: dict[str, Any] = {"url": values[0]}
        if len(values) == 2:
            if not values[1].isdigit():
                raise ValueError(f"--prefill {values[0]}: bootstrap port {values[1]!r} is not a number")
            spec["bootstrap_port"] = int(values[1])
        prefill.append(spec)
    return RouterConfig(
        prefill=prefill,
        decode=[{"url": u} for u in args.decode],
        policy=args.policy,
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        max_tree_size=args.max_tree_size,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        worker_api_key=args.worker_api_key,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ca_cert_path=args.ca_cert_path,
        disaggregation_auth_secret_file=args.disaggregation_auth_secret_file,
        request_timeout_secs=args.request_timeout_secs,
        connect_timeout_secs=args.connect_timeout_secs,
        health_check_interval_secs=args.health_check_interval_secs,
        health_check_timeout_secs=args.health_check_timeout_secs,
        health_failure_threshold=args.health_failure_threshold,
        health_success_threshold=args.health_success_threshold,
        load_check_interval_secs=args.load_check_interval_secs,
        retry_max_retries=args.retry_max_retries,
        retry_backoff_ms=args.retry_backoff_ms,
        log_level=args.log_level,
        router_processes=args.router_processes,
    )


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _cmd_serve(args: argparse.Namespace, engine_config: EngineConfig) -> int:
    from decode_server.api.server import run

    return run(engine_config, server_config_from_args(args))


def _cmd_generate(args: argparse.Namespace, engine_config: EngineConfig) -> int:
    from decode_server.engine.llm import LLM
    from decode_server.engine.sampling_params import SamplingParams, StructuredOutput
    from decode_server.errors import DecodeServerError

    try:
        bias = {int(k): float(v) for k, v in (item.split("=", 1) for item in args.logit_bias or [])}
    except ValueError:
        raise SystemExit(f"--logit-bias takes ID=BIAS (got {args.logit_bias})") from None
    structured = None
    if args.json_schema is not None:
        text = Path(args.json_schema[1:]).read_text() if args.json_schema.startswith("@") else args.json_schema
        structured = StructuredOutput(kind="json_schema", spec=text)
    elif args.regex is not None or args.ebnf is not None:
        kind = "regex" if args.regex is not None else "ebnf"
        structured = StructuredOutput(kind=kind, spec=args.regex if kind == "regex" else args.ebnf)
    params = SamplingParams(
        structured=structured,
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=args.stop or [], ignore_eos=args.ignore_eos, min_tokens=args.min_tokens,
        frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
        repetition_penalty=args.repetition_penalty, logit_bias=bias,
    )  # fmt: skip
    engine_args = engine_config.model_dump(exclude={"model_path"})
    llm = LLM(engine_config.model_path, **engine_args)
    prompts: list[Any] = list(args.prompt)
    if args.chat:
        # The rendered template already starts with BOS: encode it without adding special tokens again.
        prompts = [
            llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                                 add_special_tokens=False)
            for p in prompts
        ]  # fmt: skip
    try:
        outputs = llm.generate(prompts, params)
    except DecodeServerError as exc:  # a request the engine refuses (a grammar that does not compile, ...)
        print(f"decode-server generate: error: {exc}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompt, outputs, strict=True):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason}))  # fmt: skip
        else:
            print(f"--- prompt: {prompt!r}\n{out.text}\n--- finish_reason: {out.finish_reason}, "
                  f"{len(out.token_ids)} tokens")  # fmt: skip
    return 0


def _check_secret_file(args: argparse.Namespace) -> None:
    """The PD secret file must be readable and long enough before anything starts (SecretError says why). Not
    a config validator: configs are also built where the file does not exist (manifest checks, other hosts)."""
    path = getattr(args, "disaggregation_auth_secret_file", None)
    if path:
        from transfer.auth import load_secret

        load_secret(path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "router":
        try:
            config = router_config_from_args(args)
            _check_secret_file(args)
        except (ValidationError, ValueError) as exc:
            parser.error(str(exc))
        _setup_logging(args.log_level)
        if config.router_processes > 1:
            from decode_server.router.supervisor import run_supervised

            return run_supervised(config)
        from decode_server.router.server import run as run_router

        return run_router(config)
    if args.command == "up":
        from decode_server.up import run_up

        return run_up(args, parser)
    if args.command == "plan":
        return _cmd_plan(args, parser)
    try:
        engine_config = engine_config_from_args(args)
        if args.command == "serve":
            server_config_from_args(args)  # validate before starting anything
            _check_secret_file(args)
            if args.chat_template:
                from decode_server.model.tokenizer import read_chat_template

                read_chat_template(args.chat_template)
            if engine_config.tp_size > 1:
                from decode_server.runtime.rank_group import check_rank_devices

                check_rank_devices(engine_config)
        elif engine_config.tp_size > 1:
            raise ValueError("--tp-size > 1 runs one engine process per rank: use `decode-server serve`")
    except (ValidationError, ValueError) as exc:
        parser.error(str(exc))
    _setup_logging(args.log_level)
    if args.command == "serve":
        return _cmd_serve(args, engine_config)
    return _cmd_generate(args, engine_config)


if __name__ == "__main__":
    sys.exit(main())
