"""The PD role an engine process runs (decode_server/disagg/), chosen by `--disaggregation-mode`: one module both the
single engine's process and the rank groups use."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from decode_server.config import DisaggregationConfig

if TYPE_CHECKING:
    from decode_server.disagg.role import PDRole


def build_role(engine: Any, cfg: DisaggregationConfig, lockstep: Any = None) -> PDRole | None:
    """The PD role of `--disaggregation-mode` between the loop and the engine (None when colocated).

    `lockstep`: the `ParallelState` of a tensor-parallel group whose ranks all run every request
    (decode_server/runtime/tp_ranks.py): rank 0's role then talks to the peers for all of them (prefill: sends its
    own cache's rows; decode: receives into memory every rank maps). None for one engine, and for data-parallel
    attention's ranks, each of which receives its own requests' KV."""
    if cfg.mode == "prefill":
        from decode_server.disagg.prefill_role import PrefillRole

        return PrefillRole(engine, cfg, lockstep)
    if cfg.mode == "decode":
        from decode_server.disagg.decode_role import DecodeRole

        return DecodeRole(engine, cfg, lockstep)
    return None
