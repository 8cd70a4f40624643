"""CUDA graphs of the decode step, one per batch-size bucket (SGLang's `--cuda-graph-max-bs`, `--cuda-graph-bs`,
`--disable-cuda-graph`).

A decode batch of b requests runs as the smallest captured bucket bs >= b: rows b..bs-1 are padding. Padded rows
are requests of the backends' scratch row (forward_batch.SCRATCH_SLOTS): each decodes its "first token" at
position 0 into a scratch slot that no request owns, and its top-k is all -1 (its indexer sees no position), so
it reads no KV, loads nothing, moves no LRU state and counts no swap-in hit; its new row is never backed up. What
a step needs that changes from step to step (input ids, positions, request rows, prefix lengths, the number of
real rows) is copied into static buffers before the replay (one host-to-device copy and one device copy); every
shape inside is the bucket's, and the indexer reads every request's token table at the table's full width (the
context length) instead of the longest sequence's, so nothing the capture baked in depends on the step. The
captured region is the model forward up to the logits, the backends' per-step device work included (token → slot
gathers, the swap-in, the indexer, attention); sampling and the backup of the new rows (HiSparse) stay outside,
as in SGLang.

The same padded, static-buffer forward runs eagerly where a bucket has no graph (`capture=False`: CPU, tests), so
with graphs enabled a step's logits do not depend on whether it was replayed (tests/engine/test_cuda_graph*.py).
Graphs on versus `--disable-cuda-graph` is a different computation (GEMMs of bs rows instead of b; the indexer's
top-k over the full table width): tokens agree in our tests, logits are not promised to be bit-identical.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from decode_server.engine.forward_batch import ForwardBatch
from decode_server.engine.forward_context import forward_context
from decode_server.parallel.dp_attention import DPBatchLayout, dp_batch

if TYPE_CHECKING:
    from decode_server.config import EngineConfig
    from decode_server.engine.attention_backend import AttentionBackend

logger = logging.getLogger(__name__)

DEFAULT_MAX_BS = 256
# Eager runs of each bucket before its capture: Triton compiles, FlashMLA computes its schedule, the swap-in
# checks its arguments once and loads its extension, cuBLAS picks its kernels.
WARMUP_RUNS = 2


def default_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, 12, then every multiple of 8 up to `max_bs` (and `max_bs` itself)."""
    sizes = [b for b in [1, 2, 4, 8, 12, *range(16, max(max_bs, 16) + 1, 8)] if b <= max_bs]
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def resolve_batch_sizes(cuda_graph_bs: list[int] | None, cuda_graph_max_bs: int | None,
                        max_running_requests: int) -> list[int]:
    """The captured buckets, ascending: `--cuda-graph-bs` (sizes above `--cuda-graph-max-bs` or the request rows
    dropped) or the defaults up to min(--cuda-graph-max-bs or 256, --max-running-requests)."""
    limit = min(cuda_graph_max_bs or DEFAULT_MAX_BS, max_running_requests)
    if cuda_graph_bs is not None:
        limit = min(cuda_graph_max_bs or max(cuda_graph_bs), max_running_requests)
        sizes = sorted({b for b in cuda_graph_bs if 1 <= b <= limit})
        if not sizes:
            raise ValueError(f"--cuda-graph-bs {cuda_graph_bs}: no size within 1..{limit} (--cuda-graph-max-bs "
                             f"{cuda_graph_max_bs}, --max-running-requests {max_running_requests})")
        return sizes
    return default_batch_sizes(limit)


def bucket_for(batch_size: int, buckets: list[int]) -> int | None:
    """The smallest bucket >= batch_size; None when the batch is larger than every bucket (it runs eagerly)."""
    i = bisect.bisect_left(buckets, batch_size)
    return buckets[i] if i < len(buckets) else None


def graphs_off_reason(config: EngineConfig, device: torch.device, model_dtype: torch.dtype,
                      backend: AttentionBackend) -> str | None:
    """Why this engine runs every decode step eagerly, or None when it captures decode graphs."""
    if config.disable_cuda_graph:
        return "--disable-cuda-graph"
    if device.type != "cuda":
        return f"device {device.type} (CUDA graphs exist on CUDA only)"
    if config.disaggregation.mode == "prefill":
        return "--disaggregation-mode prefill (no decode steps)"
    if config.enable_deterministic_inference:
        return "--enable-deterministic-inference (its MoE loops over experts with counts read on the host)"
    if config.attention_backend == "torch_native":
        return "--attention-backend torch_native (the reference kernels read sizes on the host)"
    if model_dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return f"model dtype {model_dtype} (the MoE stays on the device only as a bf16 grouped GEMM)"
    if backend.scratch_row < 0:
        return "the KV backend has no scratch row for padded batches"
    return None


class DecodeGraphRunner:
    """Runs decode batches padded to a bucket: by replaying that bucket's graph, or (no graph: `capture=False`,
    or a bucket not captured) by running the very same padded forward eagerly.

    `index_width`: the token-table width the indexer reads (the engine's context length). Logits returned by
    `run` are a view of a static buffer, valid until the next `run`.

    `dp` (data-parallel attention: this rank's (dp_rank, dp_size)): every rank's batch of a graph pass is padded to
    the same bucket, so the pass's layout inside the graph is `bs` tokens and `bs` sampled rows on every rank and
    the MLPs' all-gathers and reduce-scatters have fixed sizes; the engine picks the bucket from every rank's count
    (`Engine._dp_step`) and a rank without requests replays it on padding rows only (`run_idle`).
    """

    def __init__(self, model: Any, backend: AttentionBackend, device: torch.device, buckets: list[int],
                 index_width: int, dp: tuple[int, int] | None = None) -> None:
        if not buckets or buckets != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets must be ascending distinct positive sizes, got {buckets}")
        if backend.scratch_row < 0 or buckets[-1] > backend.scratch_row:
            raise ValueError(f"bucket {buckets[-1]} exceeds the backend's {backend.scratch_row} request rows")
        self.model = model
        self.backend = backend
        self.device = device
        self.buckets = list(buckets)
        self.max_bs = self.buckets[-1]
        self.index_width = index_width
        self.dp = dp
        # Static inputs. `_meta` holds, for a bucket bs: positions [0, bs), request rows [bs, 2bs), prefix lengths
        # [2bs, 3bs) and the number of real rows at 3bs, so one contiguous copy fills a step's inputs.
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self._meta = torch.zeros(3 * self.max_bs + 1, dtype=torch.int64, device=device)
        self._ones = torch.ones(self.max_bs, dtype=torch.int64, device=device)
        self._arange = torch.arange(self.max_bs, dtype=torch.int64, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0  # device memory the capture took (free memory before − after)
        self.num_replays = 0
        self.num_eager = 0
        self.num_idle = 0  # DP attention: passes of padding rows only (`run_idle`), replayed or eager

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    # -- static inputs --
    def static_batch(self, bs: int, req_rows: list[int], prefix_lens: list[int]) -> ForwardBatch:
        """The bucket's ForwardBatch: views of the static buffers (the same memory every step) + the host lists."""
        meta = self._meta
        return ForwardBatch(
            req_rows=meta[bs : 2 * bs], prefix_lens=meta[2 * bs : 3 * bs], extend_lens=self._ones[:bs],
            positions=meta[:bs], token_req=self._arange[:bs], req_rows_cpu=req_rows, prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=[1] * bs, is_decode=True, static=True, index_width=self.index_width,
        )

    def load_inputs(self, batch: ForwardBatch, input_ids: torch.Tensor, bs: int) -> ForwardBatch:
        """Copy a decode batch of b <= bs requests into the static buffers, padded with scratch rows; returns the
        padded static batch."""
        return self._load(list(batch.req_rows_cpu), list(batch.prefix_lens_cpu), input_ids, bs)

    def _load(self, rows: list[int], prefix: list[int], input_ids: torch.Tensor | None, bs: int) -> ForwardBatch:
        b = len(rows)
        pad = bs - b
        rows = rows + [self.backend.scratch_row] * pad
        prefix = prefix + [0] * pad
        host = torch.tensor(prefix + rows + prefix + [b], dtype=torch.int64)  # positions = prefix lengths
        self._meta[: 3 * bs + 1].copy_(host, non_blocking=True)
        if b:
            self.input_ids[:b].copy_(input_ids)
        if pad:
            self.input_ids[b:bs].zero_()
        return self.static_batch(bs, rows, prefix)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The captured region: padding mask, model forward inside the forward context, logits [bs, vocab]."""
        bs = batch.batch_size
        batch.pad_mask = self._arange[:bs] >= self._meta[3 * bs : 3 * bs + 1]
        layout = None
        if self.dp is not None:
            rank, size = self.dp
            layout = DPBatchLayout((bs,) * size, (bs,) * size, rank)
        with dp_batch(layout), forward_context(batch, self.backend):
            hidden = self.model.forward(self.input_ids[:bs], batch.positions)
            return self.model.compute_logits(hidden)

    # -- per step --
    def run(self, batch: ForwardBatch, input_ids: torch.Tensor, bucket: int | None = None) -> torch.Tensor | None:
        """Logits [b, vocab] of a decode batch (one token per request), or None when b exceeds every bucket.
        `bucket`: the bucket to pad to (DP attention: the one every rank agreed on), instead of b's own."""
        if not batch.is_decode or batch.num_tokens != batch.batch_size:
            raise ValueError("the graph runner takes decode batches only")
        bs = bucket_for(batch.batch_size, self.buckets) if bucket is None else bucket
        if bs is None:
            return None
        if bs not in self.buckets or bs < batch.batch_size:
            raise ValueError(f"bucket {bs} cannot hold a batch of {batch.batch_size} (buckets {self.buckets})")
        static = self.load_inputs(batch, input_ids, bs)
        return self._run_static(static, bs, batch.batch_size)

    def run_idle(self, bucket: int) -> None:
        """DP attention: a pass of padding rows only, for a rank without requests while the others replay `bucket`
        (it joins their collectives; its logits are not read)."""
        if bucket not in self.buckets:
            raise ValueError(f"{bucket} is not one of the buckets {self.buckets}")
        self.num_idle += 1
        self._run_static(self._load([], [], None, bucket), bucket, 0)

    def _run_static(self, static: ForwardBatch, bs: int, num_real: int) -> torch.Tensor:
        self.backend.prepare_static_forward(static)
        graph = self._graphs.get(bs)
        if graph is not None:
            graph.replay()
            logits = self._outputs[bs]
            self.num_replays += 1
        else:
            logits = self._forward(static)
            self.num_eager += 1
        self.backend.finish_static_forward(static, num_real)
        return logits[:num_real]

    def release(self) -> None:
        """Destroy the captured graphs (later passes run eagerly). A process leaving its NCCL group must do this
        first: a communicator whose collectives a live graph holds cannot be destroyed, so
        `destroy_process_group` would wait forever (pytorch/pytorch#115388; seen here on 2 H200s with DP
        attention)."""
        if not self._graphs:
            return
        torch.cuda.synchronize(self.device)  # an overlapped pass may still be replaying
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._outputs.clear()

    # -- capture --
    def capture(self, buckets: list[int] | None = None) -> None:
        """Capture the given buckets (default: all), largest first, into one shared memory pool, each after
        WARMUP_RUNS eager runs of its padded forward on scratch rows only (no request's memory is touched)."""
        device = self.device
        todo = sorted(buckets if buckets is not None else self.buckets, reverse=True)
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        scratch = self.backend.scratch_row
        for bs in todo:
            if bs not in self.buckets:
                raise ValueError(f"{bs} is not one of the buckets {self.buckets}")
            rows, prefix = [scratch] * bs, [0] * bs
            self._meta[: 3 * bs + 1].copy_(torch.tensor(prefix + rows + prefix + [0], dtype=torch.int64))
            self.input_ids[:bs].zero_()
            static = self.static_batch(bs, rows, prefix)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_RUNS):
                    self.backend.prepare_static_forward(static)
                    self._forward(static)
                    self.backend.finish_static_forward(static, 0)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                output = self._forward(static)
            self._graphs[bs] = graph
            self._outputs[bs] = output
        torch.cuda.synchronize(device)
        self.capture_seconds += time.perf_counter() - start
        self.capture_bytes += free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s, %.1f MiB of device memory",
                    len(todo), sorted(todo), self.capture_seconds, self.capture_bytes / 2**20)


def build_graph_runner(engine: Any) -> tuple[DecodeGraphRunner | None, str | None]:
    """The engine's decode graph runner, captured, or (None, why) when graphs are off. A capture that fails is
    logged as an error and leaves every decode step eager (correct, only slower) rather than failing the engine;
    the reason is returned for `Engine.cuda_graph_error` (tests assert on it). With tensor parallelism the ranks
    agree first: if any rank's capture failed, every rank runs eagerly (a rank running unpadded batches while the
    others replay padded ones would join their all-reduces with other sizes)."""
    config = engine.config
    backend = engine.kv.backend
    reason = graphs_off_reason(config, engine.device, engine.model_dtype, backend)
    if reason is not None:
        logger.info("CUDA graphs off: %s", reason)
        return None, None
    buckets = resolve_batch_sizes(config.cuda_graph_bs, config.cuda_graph_max_bs,
                                  min(config.max_running_requests, backend.scratch_row))
    parallel = engine.parallel
    dp = (parallel.dp_rank, parallel.dp_size) if engine.dp_attention else None
    runner: DecodeGraphRunner | None = DecodeGraphRunner(engine.model, backend, engine.device, buckets,
                                                         engine.context_length, dp=dp)
    error = None
    try:
        with torch.inference_mode():
            runner.capture()
    except Exception as exc:  # noqa: BLE001 - any capture failure: run eagerly, say why
        logger.exception("CUDA graph capture failed; every decode step runs eagerly")
        runner, error = None, f"{type(exc).__name__}: {exc}"
    if engine.tp_size > 1 and not _every_rank_captured(runner is not None, parallel):
        if runner is not None:
            logger.error("CUDA graph capture failed on another tensor-parallel rank; every decode step runs eagerly")
        runner, error = None, error or "CUDA graph capture failed on another tensor-parallel rank"
    return runner, error


def _every_rank_captured(captured: bool, parallel: Any) -> bool:
    """One all-reduce (MIN) of the ranks' capture results over the gloo group: no device work, no hang on NCCL."""
    import torch.distributed as dist

    flag = torch.tensor([int(captured)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=parallel.cpu_group)
    return bool(flag.item())
