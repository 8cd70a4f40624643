"""Two-batch overlap (SGLang's `--enable-two-batch-overlap`): a decode step as two micro-batches on two streams.

Within one layer everything after attention depends on the swap-in (HiSparse's misses cross PCIe), so a layer's
copies can only overlap with work of other requests. A decode batch of B >= 2 requests is cut into micro-batch 0
(rows [0, ceil(B/2))) and micro-batch 1 (the rest); the model launches their layers in alternation (layer L of 0,
layer L of 1, layer L+1 of 0, ...; `DSAModel.forward_two_batch`), micro-batch 0 on the current stream and 1 on
this object's side stream, so the GPU runs one micro-batch's swap-in copies while the other's GEMMs run. Fork:
the side stream waits for the current stream once the embeddings are launched; join: the current stream waits for
the side stream before the final norm. Embeddings, final norm, logits and sampling stay whole-batch, as do the backends'
`begin_forward` / `end_forward` (slot tables, HiSparse's backup of the new rows).

Each layer of micro-batch i runs with its own forward context (`ForwardBatch.sub_batch`: rows [lo, hi), views) and
the backend's per-token state sliced to its rows (`AttentionBackend.micro_batch_state` / `swap_state`), so the
model and the backends' layer calls see an ordinary, smaller decode batch. Both micro-batches share everything
else; what they write is disjoint (each request's slots, buffer, LRU state and indexer rows belong to one
micro-batch), except:
  - the swap-in's per-layer hit/miss counters: atomics in the CUDA kernel (the reference runs only on CPU here);
  - padded rows (CUDA graph buckets) of both micro-batches write the same scratch slot and indexer row: their
    top-k is masked to -1, so nothing ever reads those values;
  - FlashMLA's per-shape tile-scheduler metadata: keyed by stream too (kernels/sparse_mla_flashmla.py);
  - one-time lazy device work (the MoE's stacked expert weights, made by the first call): the first two-batch
    forward of this object runs its micro-batches one after the other on the device, so it completes before the
    other stream reads it.
Scratch tensors of the kernels (Triton split-K partials, swap-in plans, indexer scores) are allocated per call on
the calling stream by PyTorch's caching allocator, so the two streams never share them.

On CPU the micro-batches run one after the other (the same arithmetic, no overlap). Both streams have the
default priority: the copies are spread over the swap-in kernel's blocks, which the GPU schedules beside the
other stream's kernels; giving the swap-in its own high-priority stream would add a third stream and an event
pair per layer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from decode_server.engine.forward_context import (
    ForwardBatch,
    ForwardContext,
    get_forward_context,
    use_forward_context,
)

if TYPE_CHECKING:
    from decode_server.config import EngineConfig
    from decode_server.engine.attention_backend import AttentionBackend

logger = logging.getLogger(__name__)


class TwoBatchOverlap:
    """Runs decode forwards of >= 2 requests as two alternating micro-batches (the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ordered = True  # the next forward serializes its micro-batches (the first one: lazy device work)
        self.num_forwards = 0

    @staticmethod
    def applies(batch: ForwardBatch) -> bool:
        return batch.is_decode and batch.batch_size >= 2 and batch.num_tokens == batch.batch_size

    def forward(self, model: Any, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [B, hidden] of `batch` (the current forward context's) as two micro-batches."""
        split = (batch.batch_size + 1) // 2
        hooks = _MicroBatches(batch, split, self.device, self.stream, self._ordered)
        self._ordered = False
        self.num_forwards += 1
        return model.forward_two_batch(input_ids, batch.positions, split, hooks)


class _MicroBatches:
    """One forward's two micro-batches: their forward contexts and backend states (made once, views of the whole
    batch's), their streams, fork and join (`decode_server.model.model.MicroBatchHooks`)."""

    def __init__(self, batch: ForwardBatch, split: int, device: torch.device, side: torch.cuda.Stream | None,
                 ordered: bool) -> None:
        self.backend = get_forward_context().backend
        self.parts = []
        for i, (lo, hi) in enumerate(((0, split), (split, batch.batch_size))):
            sub = batch.sub_batch(lo, hi, (i, 2))
            self.parts.append((ForwardContext(batch=sub, backend=self.backend),
                               self.backend.micro_batch_state(sub, lo, hi)))
        self.main = torch.cuda.current_stream(device) if side is not None else None
        self.side = side
        # Micro-batch 1 waits for micro-batch 0's layer, and the next layer of 0 for it (one stream in effect).
        self.ordered = ordered and side is not None

    def fork(self) -> None:
        if self.side is not None:
            self.side.wait_stream(self.main)

    @contextlib.contextmanager
    def enter(self, index: int) -> Iterator[None]:
        context, state = self.parts[index]
        outer_state = self.backend.swap_state(state)
        try:
            with use_forward_context(context), _on_stream(self.main if index == 0 else self.side):
                if self.ordered and index == 1:
                    self.side.wait_stream(self.main)
                yield
                if self.ordered and index == 1:
                    self.main.wait_stream(self.side)
        finally:
            self.backend.swap_state(outer_state)

    def join(self) -> None:
        if self.side is not None:
            self.main.wait_stream(self.side)


@contextlib.contextmanager
def _on_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield


def model_forward(model: Any, input_ids: torch.Tensor, batch: ForwardBatch,
                  two_batch: TwoBatchOverlap | None) -> torch.Tensor:
    """The model's hidden states for `batch` inside its forward context: two micro-batches where two-batch overlap
    is on and applies, the plain forward otherwise."""
    if two_batch is not None and two_batch.applies(batch):
        return two_batch.forward(model, input_ids, batch)
    return model.forward(input_ids, batch.positions)


def resolve_two_batch_overlap(config: EngineConfig, device: torch.device, tp_size: int,
                              backend: AttentionBackend) -> TwoBatchOverlap | None:
    """The engine's two-batch overlap, or None (with the reason logged) where it is off."""
    if not config.enable_two_batch_overlap:
        return None
    reason = None
    if tp_size > 1:
        reason = "--tp-size > 1 (the all-reduces of two streams would need their own NCCL communicators)"
    elif device.type == "cuda" and config.attention_backend == "torch_native":
        reason = ("--attention-backend torch_native on CUDA (the reference kernels read sizes on the host every "
                  "layer, and the reference swap-in's counter updates are not atomic across streams)")
    elif not backend.supports_micro_batches:
        reason = f"the KV backend {type(backend).__name__} cannot serve micro-batches"
    if reason is not None:
        logger.warning("two-batch overlap off: %s", reason)
        return None
    logger.info("two-batch overlap on: decode batches of >= 2 requests run as two micro-batches (%s)",
                "two CUDA streams" if device.type == "cuda" else f"one after the other on {device.type}")
    return TwoBatchOverlap(device)
