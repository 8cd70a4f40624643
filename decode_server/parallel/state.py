"""Which tensor-parallel rank this process is, and the process groups it talks through.

Every TP rank is its own process holding a shard of the model. `SINGLE` (tp_size 1) is the default everywhere:
the model is then built exactly as without parallelism and no collective runs. On CUDA the TP group uses NCCL;
a gloo group over the same ranks (`cpu_group`) carries Python objects (the runtime's broadcast of requests).

Data-parallel attention (`dp_size == tp_size`, SGLang's `--enable-dp-attention`): the same N ranks, but each rank
runs attention for its own requests with all heads (attention tensor-parallel size 1), and only the MLP layers
(dense and MoE) and the LM head are sharded across the N ranks, over the tokens of every rank gathered
(decode_server/parallel/dp_attention.py). A DP rank's index among the attention replicas is its `tp_rank`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from decode_server.config import check_dp_size

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    ep_size: int = 1  # 1 = routed experts tensor-sharded; == tp_size = experts split across the TP ranks
    group: Any = None  # torch.distributed ProcessGroup of the TP ranks (None when tp_size == 1)
    cpu_group: Any = None  # gloo group over the same ranks for Python objects (== group on CPU)
    dp_size: int = 1  # attention data-parallel replicas: 1, or tp_size (DP attention, attention TP size 1)
    enable_dp_lm_head: bool = False  # DP attention: the LM head whole on every rank instead of vocab-parallel

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside [0, tp_size={self.tp_size})")
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(
                f"ep_size {self.ep_size} is not supported with tp_size {self.tp_size}: use 1 (experts "
                f"tensor-sharded) or {self.tp_size} (experts split across the tensor-parallel ranks)"
            )
        check_dp_size(self.tp_size, self.dp_size)
        if self.enable_dp_lm_head and self.dp_size == 1:
            raise ValueError("enable_dp_lm_head needs data-parallel attention (dp_size > 1)")

    @property
    def is_driver(self) -> bool:
        return self.tp_rank == 0

    @property
    def ep_rank(self) -> int:
        """This rank's index among the expert-parallel ranks (0 when experts are not split)."""
        return self.tp_rank if self.ep_size > 1 else 0

    @property
    def expert_parallel(self) -> bool:
        return self.ep_size > 1

    @property
    def dp_attention(self) -> bool:
        """Each rank runs attention for its own requests (all heads); MLPs and the LM head run over every rank's
        tokens, gathered."""
        return self.dp_size > 1

    @property
    def dp_rank(self) -> int:
        """This rank's index among the attention data-parallel replicas (0 without DP attention)."""
        return self.tp_rank if self.dp_attention else 0

    @property
    def attention_tp_size(self) -> int:
        """Ranks one request's attention heads are split over: tp_size, or 1 with DP attention."""
        return self.tp_size // self.dp_size

    def attention_state(self) -> ParallelState:
        """The state the attention layers (and, with DP attention, the embedding) are built with: this one, or
        with DP attention a single-rank state (all heads, no collective)."""
        return SINGLE if self.dp_attention else self


SINGLE = ParallelState()


def resolve(parallel: ParallelState | None) -> ParallelState:
    """None → SINGLE."""
    return SINGLE if parallel is None else parallel


def init_parallel(
    tp_rank: int, tp_size: int, ep_size: int, init_method: str, device: torch.device,
    timeout_s: float = 300.0, dp_size: int = 1, enable_dp_lm_head: bool = False,
) -> ParallelState:
    """Join the TP group: torch.distributed.init_process_group (nccl on CUDA, gloo on CPU; init_method
    "tcp://127.0.0.1:PORT"), plus a gloo `cpu_group` over the same ranks; on CUDA sets the current device.
    `dp_size == tp_size`: data-parallel attention over the same ranks."""
    device = torch.device(device)
    # Validate before any rendezvous, so a bad size fails here and not as a hang of the other ranks.
    extra = {"dp_size": dp_size, "enable_dp_lm_head": enable_dp_lm_head}
    state = ParallelState(tp_rank=tp_rank, tp_size=tp_size, ep_size=ep_size, **extra)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if tp_size == 1:
        return state
    timeout = timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, world_size=tp_size, rank=tp_rank, timeout=timeout)
    group = dist.group.WORLD
    cpu_group = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    logger.info("tensor-parallel rank %d/%d (ep_size %d, dp_size %d) joined over %s", tp_rank, tp_size, ep_size,
                dp_size, backend)  # fmt: skip
    return ParallelState(tp_rank=tp_rank, tp_size=tp_size, ep_size=ep_size, group=group, cpu_group=cpu_group,
                         **extra)  # fmt: skip


def destroy_parallel(state: ParallelState) -> None:
    """Leave the process group (idempotent; nothing to do at tp_size 1)."""
    if state.tp_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
