"""The engine loop: take requests and aborts → schedule → forward → sample → token deltas → free finished.

Used in-process by the offline `LLM` and tests, and wrapped by the server's engine process. Every call happens
on the caller's thread; `step()` launches at most one forward pass (a prefill chunk batch or a decode step) and
returns the deltas of that pass or, with overlap scheduling, of the pass launched by the previous `step()`
(docs/engine.md "Overlap scheduling").
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from decode_server.config import EngineConfig
from decode_server.engine.cuda_graph import DecodeGraphRunner, bucket_for, build_graph_runner
from decode_server.engine.dense_kv import DenseKVManager
from decode_server.engine.detokenizer import IncrementalDetokenizer, StopStringChecker
from decode_server.engine.forward_batch import ForwardBatch
from decode_server.engine.forward_context import forward_context
from decode_server.engine.kernel_support import REFERENCE_BACKEND, check_kernel_support
from decode_server.engine.kv_manager import KVManager
from decode_server.engine.kv_rows import CacheGeometry, check_fp8_row_format
from decode_server.engine.kv_sizing import (
    KVBudgets,
    SizingRules,
    dense_slots,
    hisparse_layout,
    resolve_context_length,
)
from decode_server.engine.logits_processor import LogitsProcessor
from decode_server.engine.memory import (
    device_kv_budget,
    host_kv_budget,
    resolve_device,
    resolve_kv_dtype,
    resolve_model_dtype,
)
from decode_server.engine.prompt_logprobs import chunk_prompt_logprobs
from decode_server.engine.request import Request, RequestStatus
from decode_server.engine.sampler import SampledTokens, Sampler, is_greedy, make_generator, token_seed
from decode_server.engine.sampling_params import SamplingParams
from decode_server.engine.scheduler import ScheduledBatch, Scheduler
from decode_server.engine.structured_output import build_grammar_backend
from decode_server.engine.types import EngineStats, RequestDelta, TokenLogprob
from decode_server.errors import (
    CapacityError,
    ContextLengthExceededError,
    InvalidRequestError,
    QueueFullError,
)
from decode_server.hisparse.coordinator import HiSparseCoordinator
from decode_server.model.batch_invariant import batch_invariant_mode
from decode_server.model.moe import set_shared_experts_fusion
from decode_server.model.quantization import resolve_quantization
from decode_server.parallel.dp_attention import DPBatchLayout, DPStepSync, dp_batch
from decode_server.parallel.state import ParallelState

logger = logging.getLogger(__name__)

LogitsHook = Callable[[list[str], torch.Tensor], None]
# (request, first token position, number of tokens) of each prompt chunk a prefill pass just computed.
PrefillChunkHook = Callable[[list[tuple[Request, int, int]]], None]


def _eos_ids(model_config: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(x) for x in source)
    return frozenset(ids)


@dataclass
class _LaunchedStep:
    """A forward pass launched on the device whose sampled tokens the host has not processed yet."""

    step_id: int
    rows: frozenset[int]  # request rows the pass reads and writes
    sampled: list[Request]  # requests that get a token, in the order of `tokens`
    tokens: SampledTokens | None
    logits: torch.Tensor | None  # kept for `logits_hook` only


class Engine:
    """One model, one KV manager (dense or HiSparse), one scheduler.

    `model`, `model_config` and `tokenizer` may be passed in (tests, benchmarks); otherwise they are loaded
    from `config.model_path`. `kv_manager` replaces the one sized from the config (benchmarks size pools
    for a known context length). `logits_hook(rids, logits)` sees every sampled logits batch (tests compare modes).

    `parallel` (a `decode_server.parallel.ParallelState`) makes this engine one tensor-parallel rank: its model
    holds this rank's shard, its memory budgets are agreed with the other ranks, the HiSparse host pool is the
    node's shared one, and every rank must be driven with the same calls in the same order
    (decode_server/runtime/tp_ranks.py does that).

    With data-parallel attention (`parallel.dp_attention`) this engine is one DP rank: its own requests, scheduler
    and KV pools (a private HiSparse host pool), budgets agreed with the other ranks, and a model whose MLPs run
    over every rank's tokens. Every rank must call `step()` in every loop iteration, work or not: each step agrees
    on the pass with the others (`DPStepSync`) and a rank without work runs an idle pass so that the MLPs'
    collectives meet (decode_server/runtime/dp_ranks.py drives them).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        model: Any = None,
        model_config: Any = None,
        tokenizer: Any = None,
        kv_manager: KVManager | None = None,
        parallel: ParallelState | None = None,
    ) -> None:
        self.config = config
        self.parallel = parallel
        self.tp_size = int(getattr(parallel, "tp_size", 1))
        if self.tp_size != config.tp_size:
            raise ValueError(f"tp_size {config.tp_size} needs one engine per rank, each given its parallel state "
                             "(decode-server serve --tp-size launches them); the offline engine runs one rank")
        self.dp_attention = bool(getattr(parallel, "dp_attention", False))
        if self.dp_attention != config.enable_dp_attention or (self.dp_attention and parallel.dp_size != config.dp_size):
            raise ValueError(f"--enable-dp-attention / --dp-size {config.dp_size} and the parallel state "
                             f"(dp_size {getattr(parallel, 'dp_size', 1)}) disagree")
        # DP attention: every step agrees on the pass with the other ranks (decode_server/parallel/dp_attention.py).
        self.dp_sync = DPStepSync(parallel) if self.dp_attention else None
        self._dp_layout: DPBatchLayout | None = None  # the pass being launched (DP attention)
        self._dp_graph_bucket: int | None = None  # ... and the decode-graph bucket every rank pads it to
        self._num_idle_passes = 0
        self.device = resolve_device(config)
        if self.tp_size > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", parallel.tp_rank)  # rank r drives GPU r
        self.model_dtype = resolve_model_dtype(config, self.device)
        self.kv_dtype = resolve_kv_dtype(config, self.model_dtype)
        if model is None:
            from decode_server.model import load_config

            self._check_model_sizes(load_config(config.model_path))  # refuse before reading any weight
            set_shared_experts_fusion(not config.disable_shared_experts_fusion)
            model, model_config, tokenizer = _load(config.model_path, self.device, self.model_dtype, tokenizer,
                                                   parallel, resolve_quantization(config.quantization, self.device))
        self._check_model_sizes(model_config)
        self.model = model
        self.model_config = model_config
        # What the weights hold on the device, by kind (FP8 storage included): the count the memory planner makes of
        # the same module tree (decode_server/model/weights.py; docs/deploy.md "Planning memory").
        self.quantization = str(getattr(model, "quantization", "none"))
        self.weight_bytes = _weight_bytes(model)
        self.tokenizer = tokenizer
        self.cache_geometry = CacheGeometry.from_model_config(model_config)
        self.context_length = resolve_context_length(
            config.context_length, int(getattr(model_config, "max_position_embeddings", 0) or 0))
        # The budgets the pools were sized from (None with a `kv_manager` passed in, which was sized elsewhere).
        self.kv_budgets: KVBudgets | None = None
        self.kv = kv_manager if kv_manager is not None else self._build_kv_manager()
        if config.enable_prefix_caching:
            # Deterministic inference cuts prompts at multiples of chunked_prefill_size of their own tokens: a
            # reused prefix must end on such a cut too, so the chunks after it are the ones computed without it.
            self.kv.enable_prefix_cache(config.chunked_prefill_size if config.enable_deterministic_inference
                                        else config.page_size)
        self.attention_kernel = resolve_attention_kernel(config.attention_backend, self.device,
                                                         config.enable_deterministic_inference)
        self.kv.backend.attention_kernel = self.attention_kernel
        # Block-FP8 GEMM backends chosen by measurement before any graph captures them (kernels/fp8_gemm.py).
        self.fp8_tuning = self._warm_up_fp8()
        # CUDA graphs of the decode step per batch-size bucket (None: every step eager; decode_server/engine/cuda_graph.py)
        self.graph_runner: DecodeGraphRunner | None
        self.graph_runner, self.cuda_graph_error = build_graph_runner(self)
        priority_first = None
        if config.enable_priority_scheduling:
            priority_first = "low" if config.schedule_low_priority_values_first else "high"
        self.scheduler = Scheduler(self.kv, config.max_running_requests, config.chunked_prefill_size,
                                   priority_first=priority_first,
                                   fixed_prefill_chunks=config.enable_deterministic_inference)
        self.sampler = Sampler()
        self.logits_processor = LogitsProcessor(self.device)
        self.eos_token_ids = _eos_ids(model_config, tokenizer)
        # Structured outputs (engine/structured_output.py): None and the reason when they are refused.
        self.grammar, self.grammar_error = build_grammar_backend(
            config.grammar_backend, tokenizer, int(model_config.vocab_size), self.eos_token_ids,
            any_whitespace=not config.constrained_json_disable_any_whitespace)
        self.logits_processor.grammar = self.grammar
        self.logits_hook: LogitsHook | None = None
        # PD prefill (decode_server/disagg/): sees each prompt chunk once its KV is complete (device synced).
        self.prefill_chunk_hook: PrefillChunkHook | None = None
        self._requests: dict[str, Request] = {}
        self._special_cache: dict[int, bool] = {}  # token id → is a special token (`_is_special`)
        self._arrivals = itertools.count()
        self._pending_deltas: list[RequestDelta] = []
        self.overlap = resolve_overlap_schedule(config, self.device)
        self._inflight: _LaunchedStep | None = None  # overlap: the pass launched but not processed yet
        self._num_launched = 0
        self.num_discarded_tokens = 0  # overlap: tokens sampled for requests that had ended meanwhile, dropped
        self._num_steps = 0
        self._num_generated = 0
        self._num_prompt = 0

    def _warm_up_fp8(self) -> list[Any]:
        """Tune every FP8 GEMM shape of the model at every token count a pass can have (decode batches up to
        --max-running-requests, prefill chunks up to --chunked-prefill-size plus the decode rows mixed in; in
        batch-invariant mode the fixed row tile only). With tensor parallelism rank 0 decides and the other ranks
        adopt its decisions, and none is made later (untuned shapes take the default kernel): the replicated
        layers must run the same kernels on every rank for their outputs to stay identical."""
        if self.device.type != "cuda" or self.quantization != "fp8":
            return []
        from decode_server.model.batch_invariant import ROW_TILE
        from decode_server.model.fp8_warmup import warm_up
        from kernels.fp8_gemm import tuner

        cfg = self.config
        top_k = int(getattr(self.model_config, "num_experts_per_tok", 1) or 1)
        if cfg.enable_deterministic_inference:
            counts, grouped = [ROW_TILE], False
        else:
            # DP attention: the MLPs see every rank's tokens of a pass, up to dp_size times one rank's.
            limit = max(cfg.max_running_requests, cfg.chunked_prefill_size + cfg.max_running_requests)
            limit *= cfg.dp_attention_size
            counts, grouped = [1 << i for i in range(limit.bit_length())] + [limit], True
        if self.tp_size == 1:
            return warm_up(self.model, counts, top_k, grouped)
        import torch.distributed as dist

        records = warm_up(self.model, counts, top_k, grouped) if self.parallel.tp_rank == 0 else []
        shared = [tuner().export() if self.parallel.tp_rank == 0 else None]
        dist.broadcast_object_list(shared, src=0, group=self.parallel.cpu_group)
        if self.parallel.tp_rank != 0:
            tuner().install(shared[0], self.device)
        tuner().frozen = True
        return records

    def _check_model_sizes(self, model_config: Any) -> None:
        """MLA / indexer sizes the chosen kernels and KV format cannot run are refused here, at load."""
        check_fp8_row_format(self.kv_dtype, CacheGeometry.from_model_config(model_config))
        check_kernel_support(model_config, self.device, self.model_dtype, self.config.attention_backend,
                             self.config.attention_tp_size)

    def _kv_budgets(self) -> KVBudgets:
        """The device and host KV budgets this engine sizes its pools from: explicit, or measured
        (decode_server/engine/memory.py). With tensor parallelism every rank takes the smallest of each over the
        ranks (free GPU memory differs a little between GPUs): pool sizes decide admission and retraction, so ranks
        with different sizes would schedule differently and diverge."""
        cfg = self.config
        device_budget = device_kv_budget(cfg, self.device)
        # DP attention: one host pool per rank, so a derived budget takes a 1/dp_size share of the host's memory.
        host_budget = host_kv_budget(cfg, device_budget, num_pools=cfg.dp_attention_size) if cfg.enable_hisparse else 0
        if self.tp_size > 1:
            import torch.distributed as dist

            local = torch.tensor([device_budget, host_budget], dtype=torch.int64)
            dist.all_reduce(local, op=dist.ReduceOp.MIN, group=self.parallel.cpu_group)
            device_budget, host_budget = (int(x) for x in local.tolist())
            logger.info("tensor-parallel KV budgets agreed by %d ranks: device %.1f MiB, host %.1f MiB",
                        self.tp_size, device_budget / 2**20, host_budget / 2**20)
        return KVBudgets(device=device_budget, host=host_budget)

    def _build_kv_manager(self) -> KVManager:
        cfg = self.config
        budgets = self.kv_budgets = self._kv_budgets()
        num_layers = int(self.model_config.num_hidden_layers)
        geometry = self.cache_geometry
        rules = SizingRules.from_config(cfg)
        reference = cfg.attention_backend == REFERENCE_BACKEND
        if cfg.enable_hisparse:
            index_topk = int(self.model_config.index_topk)
            if cfg.hisparse.top_k is not None and cfg.hisparse.top_k != index_topk:
                raise ValueError(
                    f"hisparse top_k ({cfg.hisparse.top_k}) must equal the model's index_topk ({index_topk}): the "
                    "indexer of the model decides how many tokens are attended"
                )
            layout = hisparse_layout(budgets.device, budgets.host, geometry, self.kv_dtype, index_topk,
                                     self.context_length, rules)
            logger.info("hisparse layout: %s", layout)
            # TP: the node's one shared host pool; DP attention: this rank's own (its requests are its alone).
            shared = None if self.dp_attention else self.parallel
            return HiSparseCoordinator(layout, self.kv_dtype, self.device, reference, parallel=shared,
                                       prefetch_shared_layers=cfg.hisparse.prefetch_shared_layers,
                                       early_swap_in=cfg.hisparse.early_swap_in,
                                       side_stream_copy_blocks=cfg.hisparse.side_stream_copy_blocks,
                                       speculative_prefetch=cfg.hisparse.speculative_prefetch)
        slots = dense_slots(budgets.device, geometry, self.kv_dtype, cfg.page_size)
        logger.info("dense KV: %d token slots (%d B per token)", slots, geometry.bytes_per_token(self.kv_dtype))
        return DenseKVManager(num_layers, slots, cfg.max_running_requests, self.context_length, self.kv_dtype,
                              self.device, cfg.page_size, geometry, reference)

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + max_tokens − 1) one request can hold: the context length, or less when the
        whole KV cache holds less. The server clamps a defaulted max_tokens to it."""
        return min(self.context_length, self.kv.max_request_tokens)

    def close(self) -> None:
        """Destroy the decode CUDA graphs (later steps run eagerly). A tensor-/data-parallel rank calls this before
        leaving its process group: NCCL cannot destroy a communicator whose collectives a live graph holds."""
        if self.graph_runner is not None:
            self.graph_runner.release()
            self.graph_runner = None

    # -- requests --
    def add_request(
        self, rid: str, prompt_token_ids: list[int], params: SamplingParams, *, remote_prefill: bool = False,
        hold_kv: bool = False,
    ) -> None:
        """Queue a request (typed errors if it can never run).

        PD disaggregation: `remote_prefill` (decode role) admits it without a prefill pass (its prompt's KV
        arrives from elsewhere; `commit_remote_prefill` starts its decoding); `hold_kv` (prefill role) keeps
        its KV allocated after it finishes, until `release_held`."""
        req = self.validate_request(rid, prompt_token_ids, params)
        if remote_prefill and params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt logprobs are not served by a PD decode server: the prefill server "
                                      "computes the prompt", param="prompt_logprobs")
        if len(self.scheduler.waiting) >= self.config.max_queued_requests:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_queued_requests} requests)")
        req.remote_prefill, req.hold_kv = remote_prefill, hold_kv
        if not is_greedy(params):
            seed = params.seed if params.seed is not None else hash((self.config.seed, req.arrival))
            req.sampling_seed = seed
            req.generator = make_generator(seed, self.device)
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_ids,
                                                     skip_special_tokens=params.skip_special_tokens)
            req.stop_checker = StopStringChecker(params.stop)
        self._requests[rid] = req
        self.scheduler.add(req)
        self._num_prompt += req.prompt_len

    def validate_request(self, rid: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """The checks of `add_request` without queueing (raises typed errors); returns the request it would add."""
        if rid in self._requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="rid")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if params.prompt_logprobs is not None and self.dp_attention:
            raise InvalidRequestError("prompt logprobs are not served with data-parallel attention (the ranks' LM "
                                      "heads would compute different numbers of rows)", param="prompt_logprobs")
        if params.priority and not self.config.enable_priority_scheduling \
                and self.config.abort_on_priority_when_disabled:
            raise InvalidRequestError("'priority' needs a server started with --enable-priority-scheduling",
                                      param="priority")
        vocab = int(getattr(self.model_config, "vocab_size", 0) or 0)
        if vocab and any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        bad_bias = next((t for t in params.logit_bias if vocab and t >= vocab), None)
        if bad_bias is not None:
            raise InvalidRequestError(f"logit_bias token id {bad_bias} is outside the vocabulary (size {vocab})",
                                      param="logit_bias")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.context_length:
            raise ContextLengthExceededError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the "
                f"context length {self.context_length}", param="max_tokens",
            )
        req = Request(rid=rid, prompt_ids=list(prompt_token_ids), params=params, arrival=next(self._arrivals),
                      eos_token_ids=self.eos_token_ids)
        if params.structured is not None:
            param = params.structured.param or {"regex": "regex", "ebnf": "ebnf"}.get(params.structured.kind,
                                                                                        "response_format")
            if self.grammar is None:
                raise InvalidRequestError(self.grammar_error or "structured outputs are unavailable", param=param)
            try:
                req.grammar = self.grammar.compile(params.structured)
            except ValueError as exc:
                raise InvalidRequestError(str(exc), param=param) from exc
        reason = self.kv.capacity_error(req.prompt_len, req.max_total_len)
        if reason is not None:
            raise CapacityError(f"request can never fit in the KV budgets: {reason}")
        return req

    def abort_request(self, rid: str, *, hold_kv: bool = False) -> None:
        """Stop a request and free its memory; the next `step()` reports it finished with reason `abort`.
        `hold_kv`: keep its KV allocated until `release_held` (a PD transfer may still use it)."""
        self.fail_request(rid, None, None, hold_kv=hold_kv)

    def fail_request(self, rid: str, error_class: str | None, message: str | None, *, hold_kv: bool = False) -> bool:
        """End a request with an error the API reports to its client (`error_class` names a
        `decode_server.errors` class; None = a plain abort). False if the engine does not hold it."""
        req = self._requests.pop(rid, None)
        if req is None:
            return False
        self.scheduler.remove(req, hold=hold_kv)
        self.logits_processor.release(req)
        req.finish_reason = "abort"
        delta = self._delta(req, [], "", finished=True)
        delta.error, delta.error_class = message, error_class
        self._pending_deltas.append(delta)
        return True

    def release_held(self, rid: str) -> bool:
        """Free the KV of a finished request that was held (`hold_kv`)."""
        return self.scheduler.release_held(rid)

    def get_request(self, rid: str) -> Request | None:
        return self._requests.get(rid)

    def pop_remote_admitted(self) -> list[Request]:
        """PD decode: requests admitted (memory allocated) since the last call, whose KV must now be fetched."""
        return self.scheduler.pop_newly_transferring()

    def commit_remote_prefill(self, rid: str, first_token: int, logprob: TokenLogprob | None) -> RequestDelta:
        """PD decode: the prompt's KV is in this engine's pools; record the first token (sampled by the prefill
        server) and move the request into the decode batch. Returns its first delta (also the last, if the
        first token ends it)."""
        req = self._requests[rid]
        req.num_computed = req.prompt_len
        self.scheduler.commit_transferred(req)
        return self._append_token(req, first_token, logprob)

    def flush_prefix_cache(self) -> int:
        """Drop every cached prefix page no request maps (SGLang's /flush_cache); returns the tokens dropped. Safe
        at any time: pages in use stay, and requests admitted later simply find less cached."""
        dropped = self.kv.flush_prefix_cache()
        if dropped:
            logger.info("prefix cache flushed: %d tokens dropped", dropped)
        return dropped

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending_deltas) or self._inflight is not None

    def has_runnable_work(self) -> bool:
        """Something a `step()` would compute now (false while only PD transfers are awaited)."""
        sched = self.scheduler
        return bool(self._pending_deltas or sched.waiting or sched.prefilling or sched.running or sched.retracted
                    or self._inflight is not None)

    # -- one step --
    @torch.inference_mode()
    def step(self) -> list[RequestDelta]:
        """Schedule and launch one forward pass and report the tokens of the newest pass the host has read.

        Without overlap a step launches its pass, waits for its tokens and reports them. With overlap (SGLang's
        overlap scheduler) a step launches pass N+1 first, its input ids taken on the device from pass N's sampled
        tokens, and only then reads pass N's tokens and runs their stop checks, detokenization and frees, while
        the device computes pass N+1. A request that pass N finished already ran in pass N+1: that extra token is
        dropped, and the request's memory is freed once pass N+1 has finished (`Scheduler.release_rows_of`).
        """
        deltas, self._pending_deltas = self._pending_deltas, []
        if self.dp_sync is not None:
            return deltas + self._dp_step()
        deltas += self._read_constrained_inflight()
        shared_pool = self.tp_size > 1 and self.config.enable_hisparse
        if shared_pool:
            self._shared_pool_barrier()  # every rank is done with the pages freed before this step
        batch = self.scheduler.schedule()
        launched = None
        if batch is not None and batch.requests:
            if shared_pool:
                self._shared_pool_barrier()  # ... and with the pages that scheduling retracted
            launched = self._launch(batch)
        return deltas + self._read_pass(self._rotate_inflight(launched))

    def _dp_step(self) -> list[RequestDelta]:
        """One DP rank's step: schedule its own requests, agree with every rank on the pass (all counts), then run
        its batch, or an idle pass (no token, the MLPs' collectives only) when it has none but another rank has
        one; when no rank has a token, nobody runs a pass. Then, as in `step()`, read the pass just launched (no
        overlap) or the one launched before it (overlap: this rank's own pass in flight; an idle pass has none).

        With CUDA graphs, a pass where every rank has a decode batch (or none) that fits a bucket is a graph pass:
        every rank pads to the bucket of the largest rank's batch and replays it (a rank without requests on
        padding rows only), so the MLPs' collectives inside the graph have the sizes they were captured with.
        Any other pass (a prefill chunk anywhere, a batch above every bucket) runs eagerly on every rank."""
        assert self.dp_sync is not None
        deltas = self._read_constrained_inflight()
        batch = self.scheduler.schedule()
        if batch is not None and not batch.requests:
            batch = None
        tokens = sum(batch.extend_lens) if batch is not None else 0
        sampled = sum(batch.sampled) if batch is not None else 0
        graphable = self.graph_runner is not None and (batch is None or (
            batch.is_decode and all(batch.sampled) and tokens == len(batch.requests)))
        layout = self.dp_sync.agree(tokens, sampled, graphable)
        launched = None
        if layout.total_tokens:
            graph_batch = layout.graph_batch()
            self._dp_layout = layout
            self._dp_graph_bucket = None
            if graph_batch is not None and self.graph_runner is not None:
                self._dp_graph_bucket = bucket_for(graph_batch, self.graph_runner.buckets)
            try:
                if batch is None:
                    self._num_idle_passes += 1
                    if self._dp_graph_bucket is not None:
                        self.graph_runner.run_idle(self._dp_graph_bucket)
                    else:
                        self._idle_pass()
                else:
                    launched = self._launch(batch)
            finally:
                self._dp_layout = None
                self._dp_graph_bucket = None
        return deltas + self._read_pass(self._rotate_inflight(launched))

    def _read_constrained_inflight(self) -> list[RequestDelta]:
        """With a constrained request in the pass in flight, read that pass now, before scheduling the next: a
        grammar's next bitmask needs the token in flight (overlap is off for such passes)."""
        if self._inflight is None or not any(r.params.structured is not None and not r.finished
                                             for r in self._inflight.sampled):
            return []
        previous, self._inflight = self._inflight, None
        return self._read_pass(previous)

    def _rotate_inflight(self, launched: _LaunchedStep | None) -> _LaunchedStep | None:
        """The pass to read now: with overlap the one launched before `launched` (which stays in flight), without
        it `launched` itself."""
        previous, self._inflight = self._inflight, None
        if self.overlap:
            self._inflight = launched
        elif launched is not None:
            previous = launched
        return previous

    def _idle_pass(self) -> None:
        """A pass without tokens: attention is skipped, the MLPs and the LM head join the other ranks' collectives
        with zero rows (SGLang's idle batch)."""
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        with batch_invariant_mode(self.config.enable_deterministic_inference), dp_batch(self._dp_layout):
            hidden = self.model.forward(empty, empty)
            self.model.compute_logits(hidden)

    @torch.inference_mode()
    def flush(self) -> list[RequestDelta]:
        """Read the pass in flight (overlap scheduling) without launching another, and free the memory deferred
        behind it (the offline `LLM` calls it when its requests are done, so the engine ends idle)."""
        deltas, self._pending_deltas = self._pending_deltas, []
        previous, self._inflight = self._inflight, None
        return deltas + self._read_pass(previous)

    def _read_pass(self, previous: _LaunchedStep | None) -> list[RequestDelta]:
        """Process `previous` while `self._inflight` (if any) may still run: rows of the latter freed meanwhile
        are deferred until it has been read."""
        sched = self.scheduler
        if self._inflight is not None:
            sched.inflight_rows, sched.inflight_step = self._inflight.rows, self._inflight.step_id
        else:
            sched.inflight_rows = frozenset()
        if previous is None:
            return []
        deltas = self._process(previous)
        sched.release_rows_of(previous.step_id)
        return deltas

    def _launch(self, batch: ScheduledBatch) -> _LaunchedStep:
        """Build the pass's inputs, run the forward and sample on the device; nothing here waits for the device
        (except a PD prefill hook, which needs the chunk's KV complete)."""
        self._num_launched += 1
        rows = [r.row for r in batch.requests]
        fb = ForwardBatch.build(rows, batch.prefix_lens, batch.extend_lens, self.device)
        # A prefill batch whose chunks are all one token long is still prefill (HiSparse routes it differently).
        fb.is_decode = batch.is_decode
        sampled_mask = batch.sampled
        input_ids = self._input_ids(batch)
        logits = self._forward(input_ids, fb, sampled_mask, batch)
        self._num_steps += 1
        sampled = [r for r, s in zip(batch.requests, sampled_mask, strict=True) if s]
        for req, n in zip(batch.requests, batch.extend_lens, strict=True):
            req.num_computed += n
        for req in sampled:
            if req.status is RequestStatus.PREFILLING:
                self.scheduler.on_prefill_done(req)  # the prompt's KV is complete: it decodes from the next pass
        if self.prefill_chunk_hook is not None and not batch.is_decode:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the chunk's KV rows are complete
            self.prefill_chunk_hook([(r, p, e) for r, p, e in zip(batch.requests, batch.prefix_lens,
                                                                  batch.extend_lens, strict=True)])
        step = _LaunchedStep(self._num_launched, frozenset(rows), sampled, None, None)
        if not sampled:
            return step
        for req in sampled:
            if req.generator is not None and req.sampling_seed is not None:  # seeded by output index
                req.generator.manual_seed(token_seed(req.sampling_seed, req.num_output_tokens))
        processed = self.logits_processor.apply(logits, sampled)
        step.tokens = self.sampler.sample_on_device(processed, [r.params for r in sampled],
                                                    [r.generator for r in sampled], model_logits=logits)
        self.logits_processor.record(step.tokens.tokens)
        if self.overlap:
            step.tokens.start_copy()
        for i, req in enumerate(sampled):
            req.num_pending += 1
            req.future_index = i
        step.logits = logits if self.logits_hook is not None else None
        return step

    def _input_ids(self, batch: ScheduledBatch) -> torch.Tensor:
        """The pass's input ids on the device. A token the host has not read yet (sampled by the pass still in
        flight) is taken from that pass's device tensor: the future-token map of overlap scheduling."""
        ids: list[int] = []
        dst: list[int] = []
        src: list[int] = []
        for req, p, e in zip(batch.requests, batch.prefix_lens, batch.extend_lens, strict=True):
            known = req.num_tokens - req.num_pending
            for pos in range(p, p + e):
                if pos < known:
                    ids.append(req.token_at(pos))
                    continue
                if req.num_pending != 1 or pos != known or self._inflight is None or self._inflight.tokens is None:
                    raise RuntimeError(f"{req.rid}: input token {pos} is neither known nor in the launched pass")
                dst.append(len(ids))
                src.append(req.future_index)
                ids.append(0)
        input_ids = torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True)
        if dst:
            assert self._inflight is not None and self._inflight.tokens is not None
            index = torch.tensor([dst, src], dtype=torch.int64).to(self.device, non_blocking=True)
            input_ids.index_copy_(0, index[0], self._inflight.tokens.tokens.index_select(0, index[1]))
        return input_ids

    def _process(self, step: _LaunchedStep) -> list[RequestDelta]:
        """Read a launched pass's tokens (the one host sync) and turn them into deltas: stop checks,
        detokenization, finishes. Tokens of requests that ended meanwhile (finished by the pass before, aborted,
        failed) are dropped."""
        if step.tokens is None:
            return []
        tokens, logprobs = step.tokens.read()
        keep = []
        for i, req in enumerate(step.sampled):
            req.num_pending -= 1
            if not req.finished:
                keep.append(i)
        self.num_discarded_tokens += len(step.sampled) - len(keep)
        if self.logits_hook is not None and step.logits is not None and keep:
            logits = step.logits if len(keep) == len(step.sampled) else step.logits[keep]
            self.logits_hook([step.sampled[i].rid for i in keep], logits)
        return [self._append_token(step.sampled[i], tokens[i], logprobs[i]) for i in keep]

    def _shared_pool_barrier(self) -> None:
        """The ranks share one host pool: a page freed by one request (finished, aborted, retracted) may be handed to
        another in the next scheduling or forward, and no rank may write the new owner's rows (a resume's copy-in
        during `schedule()`, prefill rows and backups during the forward) while a slower rank still reads or writes
        the old owner's (its last backup, a retraction's copy-out). Frees wait for their backup on the host and
        retractions copy out on the host, so host barriers before `schedule()` and before the forward order them."""
        import torch.distributed as dist

        dist.barrier(group=self.parallel.cpu_group)

    def _forward(self, input_ids: torch.Tensor, fb: ForwardBatch, sampled: list[bool],
                 batch: ScheduledBatch | None = None) -> torch.Tensor:
        """input ids (device) + ForwardBatch → logits of the sampled requests' last tokens (and, in a prefill pass,
        the prompt logprobs of the requests of `batch` asking for them)."""
        # DP attention: only in a graph pass every rank agreed on (the others run eagerly, unpadded).
        graph_pass = not self.dp_attention or self._dp_graph_bucket is not None
        if fb.is_decode and self.graph_runner is not None and all(sampled) and graph_pass:
            # padded to a bucket (DP: the agreed one); None: larger than every bucket
            logits = self.graph_runner.run(fb, input_ids, bucket=self._dp_graph_bucket)
            if logits is not None:
                # A view of the graph's static output, overwritten by the next replay: a hook may keep it longer.
                return logits.clone() if self.logits_hook is not None else logits
        with batch_invariant_mode(self.config.enable_deterministic_inference), dp_batch(self._dp_layout):
            with forward_context(fb, self.kv.backend):
                hidden = self.model.forward(input_ids, fb.positions)
            if batch is not None and not batch.is_decode:
                self._record_prompt_logprobs(batch, hidden)
            if fb.is_decode and all(sampled):
                return self.model.compute_logits(hidden)  # one token per request, every one sampled: no gather
            pick = torch.tensor([i for i, s in enumerate(sampled) if s], dtype=torch.int64)
            last = fb.last_token_indices[pick.to(self.device, non_blocking=True)]
            return self.model.compute_logits(hidden[last])

    def _record_prompt_logprobs(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """Prompt logprobs of this prefill pass's chunks, for the requests that ask (hidden rows are the pass's
        tokens, request after request)."""
        offset = 0
        for req, start, n in zip(batch.requests, batch.prefix_lens, batch.extend_lens, strict=True):
            k = req.params.prompt_logprobs
            if k is not None and start < req.prompt_len:
                req.prompt_logprobs += chunk_prompt_logprobs(self.model, hidden[offset : offset + n], req.prompt_ids,
                                                             start, k)  # fmt: skip
            offset += n

    def _append_token(self, req: Request, token: int, logprob: Any) -> RequestDelta:
        if req.status is RequestStatus.PREFILLING:
            self.scheduler.on_prefill_done(req)
        req.output_ids.append(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        self._num_generated += 1
        finished = req.check_token_stop(token)
        ended_on_token = finished and req.finish_reason == "stop"  # EOS or a stop token id
        error = None
        if not self.logits_processor.accept(req, token):
            logger.error("%s: token %d does not match its grammar; ending it", req.rid, token)
            finished, error = True, f"the output left its structured-output grammar at token {token}"
            req.finish_reason, req.stop_reason = "abort", None
        text = ""
        if req.detokenizer is not None and req.stop_checker is not None:
            armed = len(req.output_ids) >= req.params.min_tokens
            # The special token that ended the request (EOS) is no part of the answer, even when special tokens
            # are kept in the text (as with skip_special_tokens, the default, where it decodes to nothing).
            hidden = ended_on_token and not req.params.skip_special_tokens and self._is_special(token)
            text = req.stop_checker.add("" if hidden else req.detokenizer.add([token]), armed=armed)
            if req.stop_checker.matched is not None and not finished:
                finished = True
                req.finish_reason, req.stop_reason = "stop", req.stop_checker.matched
            elif finished:
                text += req.stop_checker.add(req.detokenizer.flush()) + req.stop_checker.finish()
        if finished:
            self._requests.pop(req.rid, None)
            self.scheduler.remove(req, hold=req.hold_kv)
            self.logits_processor.release(req)
        delta = self._delta(req, [token], text, finished, [logprob] if logprob is not None else None)
        if error is not None:
            delta.error, delta.error_class = error, "DecodeServerError"
        return delta

    def _is_special(self, token: int) -> bool:
        """Whether the tokenizer drops `token` when it skips special tokens (cached per token)."""
        special = self._special_cache.get(token)
        if special is None:
            special = self._special_cache[token] = (
                self.tokenizer.decode([token], skip_special_tokens=True) == ""
                and self.tokenizer.decode([token], skip_special_tokens=False) != "")
        return special

    def _delta(self, req: Request, tokens: list[int], text: str, finished: bool,
               logprobs: list[Any] | None = None) -> RequestDelta:
        prompt_logprobs = None
        if req.params.prompt_logprobs is not None and len(req.output_ids) == 1 and tokens:  # the first token
            prompt_logprobs = [None, *req.prompt_logprobs]
        return RequestDelta(
            rid=req.rid, new_token_ids=tokens, text=text, finished=finished,
            finish_reason=req.finish_reason if finished else None, stop_reason=req.stop_reason if finished else None,
            prompt_tokens=req.prompt_len, completion_tokens=len(req.output_ids), logprobs=logprobs,
            cached_tokens=req.num_cached_tokens, prompt_logprobs=prompt_logprobs,
        )

    # -- introspection --
    def stats(self) -> EngineStats:
        usage = self.kv.usage()
        sched = self.scheduler
        return EngineStats(
            num_running_reqs=len(sched.running) + len(sched.prefilling),
            num_queue_reqs=len(sched.waiting),
            num_retracted_reqs=len(sched.retracted),
            token_usage=self.kv.token_usage(),
            num_generated_tokens=self._num_generated,
            num_prompt_tokens=self._num_prompt,
            num_steps=self._num_steps,
            num_retractions=sched.num_retractions,
            num_idle_passes=self._num_idle_passes,
            hisparse_enabled=self.config.enable_hisparse,
            hisparse_layers=self.kv.layer_stats(),
            quantization=self.quantization,
            weights_bytes=self.weight_bytes.get("total", 0),
            weights_bytes_by_kind={k: v for k, v in self.weight_bytes.items() if k != "total"},
            device_kv_budget_bytes=self.kv_budgets.device if self.kv_budgets is not None else 0,
            host_kv_budget_bytes=self.kv_budgets.host if self.kv_budgets is not None else 0,
            prefix_cache=self.kv.prefix_cache_stats(),
            **usage,
        )

    def is_idle_and_empty(self) -> bool:
        """No request anywhere and every pool back to zero (tests assert it)."""
        return (not self._requests and self._inflight is None and not self.scheduler.has_work()
                and self.kv.is_empty() and self.logits_processor.is_empty())


def resolve_overlap_schedule(config: EngineConfig, device: torch.device) -> bool:
    """Whether `step()` overlaps the host's work with the device's (docs/engine.md "Overlap scheduling").

    On by default on CUDA, where kernels run asynchronously and the host can prepare the next pass meanwhile. Off
    by default on CPU: torch's CPU operators run as they are called, so nothing would overlap and each request
    ending on EOS or a stop string would cost one wasted token of compute; `force_overlap_schedule` runs the same
    code path on CPU (tests). Tensor-parallel and DP-attention ranks overlap alike: every rank launches and reads
    its passes in the same order as the others (a TP rank the very same passes; a DP rank its own, agreed on
    before they run), and a page freed behind a pass in flight is handed out again only after that pass was read
    (with TP's shared host pool, on every rank: the barrier at the next `step()`)."""
    if config.disable_overlap_schedule:
        return False
    return config.force_overlap_schedule or device.type == "cuda"


def resolve_attention_kernel(name: str, device: torch.device, deterministic: bool = False) -> str:
    """--attention-backend → the sparse MLA kernel the backends pass to `kernels.sparse_mla_decode`.

    "auto": FlashMLA on a Hopper GPU where the `sgl-flash-mla` wheel imports, Triton otherwise (off CUDA the
    kernels run their PyTorch reference whatever the name). "flashmla" without FlashMLA is a configuration error.
    With `--enable-deterministic-inference` attention runs the Triton kernel with one split (FlashMLA's split
    scheduling follows the batch size, so it is not batch-invariant): "auto" resolves to "triton" and an explicit
    "flashmla" is refused.
    """
    from kernels.sparse_mla_flashmla import flashmla_available

    if deterministic:
        if name == "flashmla":
            raise ValueError("--attention-backend flashmla cannot be batch-invariant (its split scheduling follows "
                             "the batch); --enable-deterministic-inference runs the Triton kernel with one split")
        return "triton" if name == "auto" else name
    available = device.type == "cuda" and flashmla_available(device)
    if name == "auto":
        return "flashmla" if available else "triton"
    if name == "flashmla" and not available:
        raise ValueError("--attention-backend flashmla needs a Hopper GPU and the sgl-flash-mla wheel "
                         "(pip install 'hisparse-decode-server[flashmla]')")
    return name


def _weight_bytes(model: Any) -> dict[str, int]:
    from decode_server.model.weights import weight_bytes

    return weight_bytes(model) if isinstance(model, torch.nn.Module) else {}


def _load(model_path: str, device: torch.device, dtype: torch.dtype, tokenizer: Any,
          parallel: ParallelState | None = None, quantization: str = "auto") -> tuple[Any, Any, Any]:  # fmt: skip
    from decode_server.model import Tokenizer, load_model, resolve_model_path

    # With TP: this rank's shard.
    model, model_config = load_model(model_path, device, dtype, parallel=parallel, quantization=quantization)
    if tokenizer is None:
        tokenizer = Tokenizer.from_dir(resolve_model_path(model_path))
    return model, model_config, tokenizer
