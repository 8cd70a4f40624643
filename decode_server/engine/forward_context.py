"""Per-step forward state: the batch of one forward pass (decode_server/engine/forward_batch.py) and the
attention backend that holds its KV.

The model never knows where KV lives. Each attention layer reads the current `ForwardContext` (installed by the
engine through `forward_context(...)`, which refuses nesting) and hands its tensors to the context's
attention backend. Dense and HiSparse backends differ only in where the KV rows come from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from decode_server.engine.attention_backend import AttentionBackend
from decode_server.engine.forward_batch import ForwardBatch


@dataclass
class ForwardContext:
    """What the attention layers need during one forward pass."""

    batch: ForwardBatch
    backend: AttentionBackend


_current: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(batch: ForwardBatch, backend: AttentionBackend) -> Iterator[ForwardContext]:
    """Install the per-step context for the duration of one forward pass (nesting is a bug)."""
    global _current
    if _current is not None:
        raise RuntimeError("forward_context is already active: forward passes must not nest")
    _current = ForwardContext(batch=batch, backend=backend)
    try:
        backend.begin_forward(batch)
    except BaseException:
        _current = None  # a refused batch must not leave the context installed for every later step
        raise
    try:
        yield _current
    finally:
        _current = None
        backend.end_forward(batch)


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context: call the model inside `forward_context(batch, backend)`")
    return _current
