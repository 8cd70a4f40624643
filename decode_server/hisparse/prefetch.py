"""Swap-ins started before the attention that needs them: a layer's own (`early`) and GLM-5's shared layers'.

Own layer (`HiSparseConfig.early_swap_in`, issue 23 item 4): the model selects first (indexer, top-k) and only
then computes the absorbed query and the new KV row (decode_server/model/attention.py), so the backend starts the
layer's swap-in from `prepare_attention` (called right after the selection) on a side stream, and the plan
kernel's latency and the miss copies run beside those projections instead of before the attention (at batch 1
the swap-in was ~3 % of a step).

Shared layers (`HiSparseConfig.prefetch_shared_layers`, issue 23 item 3): their misses are known one or more layers
early. A "shared" layer has no indexer: it attends over the top-k positions of the previous full layer
(decode_server/model/attention.py `forward_with_topk`). So once full layer L's top-k is known, the swap-ins of its
followers L+1..L+s (the shared layers up to the next full layer) can start at once, on a side stream, and their
host→device copies overlap L's attention and MoE and the followers' projections instead of sitting on the
critical path of each follower's attention.

Why the result stays bit-identical (tests/hisparse/test_prefetch_shared.py checks it against dense and against
the prefetch switched off, with misses in the shared layers):
- layer j's swap-in reads and updates only layer j's state: its `buffer_tokens` / `lru_order` rows, its counters,
  the host pool rows of layer j and writes the device pool rows of layer j (kernels/swap_in_tables.py). Nothing
  else in the forward changes any of it before layer j's attention, so running it earlier (at layer j's
  `prepare_attention`, or at its full layer) gives the same slots and the same copies;
- the only write to layer j's device rows in a decode forward besides the swap-in is `write_kv(j)`: the new token
  goes to its identity slot while seq_len <= D (the swap-in's fast path then copies nothing), else to its ring
  slot D + t mod R, which the swap-in never hands to a miss (misses take LRU positions < D; the new token,
  t = seq_len - 1 >= D, is a ring hit, kernels/swap_in_ref.py). So swap-in(j) and write_kv(j) commute, and the
  swap-in never reads the new token's host row (not backed up yet);
- the host rows the swap-in reads were written by earlier steps' backups: the forward's stream already waits
  for the last one (`prepare_static_forward` → `wait_backup_on_current_stream`), and the side stream waits for
  the forward's stream before it starts;
- the follower must receive the very top-k tensor its full layer received (the model carries it down the stack);
  `take` checks that and refuses otherwise rather than attend over a stale selection.

On CPU there are no streams: the prefetch is the same swap-in calls made earlier, in the same order per layer.
On CUDA each launch runs on a dedicated side stream that first waits for the current stream; each follower gets
an event recorded after its swap-in, and its attention's stream waits for that event (a fork and join, legal
inside CUDA-graph capture). `join` waits for whatever is still pending (end of forward, aborted forward) so that
nothing launched in one forward outlives it or leaks into the next.

Allocator: the slots tensor is allocated on the side stream and read on the forward's stream, so `take` records
that use (`Tensor.record_stream`) before handing it out; the inputs (top-k, seq_lens, request rows, allocated on
the forward's stream) are held by the pending entry until the forward's stream has waited for the side stream,
so the caching allocator cannot hand their memory out while the side stream still reads it.

An aborted forward leaves its prefetched followers' swap-ins done (their tables then describe what their slots
hold, so the buffers stay consistent; only which tokens are cached differs, which never changes a result).

Speculative (`HiSparseConfig.speculative_prefetch`, issue 23 item 3, for DSA layers that select on their own): once
full layer L's top-k is known, the next full layer N (L+1 in DeepSeek-V3.2) runs a swap-in of L's selection
against N's own tables on the side stream, betting that N will select many of the same tokens (adjacent DSA
layers' top-k overlap 70-100 %, IndexCache, arXiv 2603.12201). N then runs its own swap-in as always: the tokens the
bet loaded are hits, and their copies ran beside L's attention and MoE and N's projections. It never changes what
attention reads (N attends over the slots of its own swap-in, made after the bet; every slot holds the host row
of the token its table names, so which tokens a bet loaded or kept warm cannot change a bit), and it is ordered
like a follower's swap-in (N's own swap-in waits for it). The bet's hits and misses go to their own counters, so
the layer's hit rate stays the rate of its real selections. A wrong bet costs PCIe bytes and LRU places.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from decode_server.engine.kv_rows import CacheGeometry

logger = logging.getLogger(__name__)

SwapIn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def next_full_layers(geometry: CacheGeometry) -> dict[int, int]:
    """Full layer id → the next full layer (the one a speculative prefetch bets on); the last one maps nowhere."""
    full = sorted(geometry.index_layer_ids)
    return dict(zip(full, full[1:], strict=False))


def rows_saved_by_bets(misses: Sequence[int], geometry: CacheGeometry) -> dict[int, int]:
    """Full layer that receives bets and has shared followers → rows its own swap-ins did not have to copy thanks
    to the bets (its first follower's misses − its own, cumulative).

    Why this is the bets' payoff, measured on the live model: a shared follower swaps in exactly its full layer's
    top-k every step into a buffer of the same size, so without bets its buffer and counters evolve exactly like
    the full layer's (tested). With bets only the full layer's buffer also receives the previous full layer's
    selection; the follower keeps what the full layer would have missed without them. Negative when the bets
    evicted rows the layer then needed. The bets' cost is the rows they copied (`speculative_misses`). Models
    without shared layers (DeepSeek-V3.2) have no such counterfactual: their layers map nowhere here."""
    followers = shared_followers(geometry)
    return {layer: misses[followers[layer][0]] - misses[layer]
            for layer in next_full_layers(geometry).values() if layer in followers}


def shared_followers(geometry: CacheGeometry) -> dict[int, tuple[int, ...]]:
    """Full layer id → the shared layers that reuse its top-k (those after it, up to the next full layer).

    Only full layers with at least one follower appear. Shared layers before the first full layer have no top-k
    to reuse (the model refuses them), so they follow nobody."""
    full = set(geometry.index_layer_ids)
    followers: dict[int, tuple[int, ...]] = {}
    current: int | None = None
    run: list[int] = []
    for layer in range(geometry.num_layers):
        if layer in full:
            if current is not None and run:
                followers[current] = tuple(run)
            current, run = layer, []
        elif current is not None:
            run.append(layer)
    if current is not None and run:
        followers[current] = tuple(run)
    return followers


@dataclass
class _Prefetched:
    """One follower's swap-in, launched at its full layer."""

    slots: torch.Tensor  # [B, K] int32 device slots its attention reads
    source: torch.Tensor  # the top-k tensor the full layer received; the follower must receive the same one
    event: torch.cuda.Event | None  # recorded on the side stream after the swap-in (CUDA); None on CPU
    inputs: tuple[torch.Tensor, ...]  # read by the side stream: kept alive until the forward's stream joined it


class SwapInPrefetch:
    """Launches swap-ins ahead of their attention (a layer's own with `early`, the followers' at their full layer)
    and hands their slots to the attention.

    `swaps` is the backend's list of bound swap-ins (read at call time, so a profiler's wrappers see the calls).
    """

    def __init__(self, followers: dict[int, tuple[int, ...]], swaps: Sequence[SwapIn], device: torch.device,
                 early: bool = False, speculative: dict[int, int] | None = None,
                 speculative_swaps: Sequence[SwapIn | None] = ()) -> None:  # fmt: skip
        """`speculative`: full layer → the layer whose swap-in of the full layer's top-k it launches as a bet,
        with `speculative_swaps[layer]` (the layer's tables, the bet's own counters)."""
        self.followers = followers
        self.swaps = swaps
        self.device = device
        self.early = early
        self.speculative = speculative or {}
        self.speculative_swaps = speculative_swaps
        if any(layer >= len(speculative_swaps) or speculative_swaps[layer] is None
               for layer in self.speculative.values()):
            raise ValueError("speculative prefetch needs a bound swap-in for every layer it bets on")
        # One side stream for all launches: the swap-ins run one after another in layer order, like the forward
        # would have run them; created only where there is something to launch. With `early`, high priority: the
        # attention right after the projections waits for it, so its blocks go first when those free an SM (the
        # followers alone keep the default priority they were measured with).
        wanted = device.type == "cuda" and (early or bool(followers) or bool(self.speculative))
        self.stream = torch.cuda.Stream(device, priority=-1 if early else 0) if wanted else None
        self._pending: dict[int, _Prefetched] = {}
        self._bets: dict[int, _Prefetched] = {}  # layer → its speculative swap-in, until its own swap-in waited
        self.launched = 0  # follower swap-ins launched at their full layer (tests and stats)
        self.early_launched = 0  # layers' own swap-ins launched from their prepare_attention
        self.speculative_launched = 0  # bets launched at the full layer before

    @property
    def pending_layers(self) -> tuple[int, ...]:
        """Followers whose prefetched slots are not taken yet (empty between forwards)."""
        return tuple(self._pending)

    @property
    def pending_bets(self) -> tuple[int, ...]:
        """Layers whose speculative swap-in their own swap-in has not waited for yet (empty between forwards)."""
        return tuple(self._bets)

    def launch(self, layer_id: int, source: torch.Tensor, top_k: torch.Tensor, seq_lens: torch.Tensor,
               req_rows: torch.Tensor, include_self: bool = False) -> None:  # fmt: skip
        """Start full layer `layer_id`'s followers' swap-ins with the same batch, after its own: from its attention
        (which ran its own swap-in), or with `include_self` from its `prepare_attention`, its own first.

        `source` is the top-k tensor the layer received, `top_k` its int32 contiguous form the swap-in takes."""
        layers = ((layer_id,) if include_self else ()) + self.followers.get(layer_id, ())
        bet = self.speculative.get(layer_id)
        if not layers and bet is None:
            return
        inputs = (source, top_k, seq_lens, req_rows)
        stream = self.stream
        if stream is None:
            for layer in layers:
                entry = _Prefetched(self.swaps[layer](top_k, seq_lens, req_rows), source, None, inputs)
                self._put(layer, entry, own=layer == layer_id)
            if bet is not None:
                self._put_bet(bet, _Prefetched(self.speculative_swaps[bet](top_k, seq_lens, req_rows), source, None,
                                               inputs))
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for layer in layers:
                slots = self.swaps[layer](top_k, seq_lens, req_rows)
                event = torch.cuda.Event()
                event.record(stream)
                self._put(layer, _Prefetched(slots, source, event, inputs), own=layer == layer_id)
            if bet is not None:  # after the followers: they attend sooner and for certain
                slots = self.speculative_swaps[bet](top_k, seq_lens, req_rows)
                event = torch.cuda.Event()
                event.record(stream)
                self._put_bet(bet, _Prefetched(slots, source, event, inputs))

    def _put_bet(self, layer: int, entry: _Prefetched) -> None:
        if layer in self._bets:
            raise RuntimeError(f"layer {layer} had two speculative swap-ins in one forward")
        self._bets[layer] = entry
        self.speculative_launched += 1

    def before_own_swap_in(self, layer_id: int) -> None:
        """Called right before `layer_id`'s own swap-in on the current stream: that stream waits for the layer's
        speculative swap-in (both update the layer's tables, the bet first)."""
        entry = self._bets.pop(layer_id, None)
        if entry is not None and entry.event is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.event)

    def _put(self, layer: int, entry: _Prefetched, own: bool) -> None:
        if layer in self._pending:
            raise RuntimeError(f"layer {layer} was prefetched twice in one forward")
        self._pending[layer] = entry
        if own:
            self.early_launched += 1
        else:
            self.launched += 1

    def take(self, layer_id: int, source: torch.Tensor) -> torch.Tensor | None:
        """The slots launched early for `layer_id` (the current stream then waits for them), or None if none were."""
        entry = self._pending.pop(layer_id, None)
        if entry is None:
            return None
        if entry.source is not source:
            # Its tables were already updated for the selection it was launched with: attending over another one
            # would read wrong rows, so refuse (the model hands its attention the tensor it prepared with, and a
            # shared layer its full layer's, unchanged).
            raise RuntimeError(f"layer {layer_id} attends over a top-k other than the one its swap-in was launched "
                               "with")
        if entry.event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(entry.event)
            entry.slots.record_stream(current)
        # A layer's own early swap-in ran on the side stream after its bet, so this wait covered the bet too.
        self._bets.pop(layer_id, None)
        return entry.slots

    def join(self) -> None:
        """The current stream waits for every launched swap-in not taken yet, which are then dropped: called at
        the end of every forward (normal or aborted, inside a CUDA-graph capture too), so no side-stream work
        outlives the forward that launched it."""
        if not self._pending and not self._bets:
            return
        logger.debug("joining %d early swap-ins never taken (layers %s) and %d bets (layers %s)", len(self._pending),
                     sorted(self._pending), len(self._bets), sorted(self._bets))
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            for entry in (*self._pending.values(), *self._bets.values()):
                if entry.event is not None:
                    current.wait_event(entry.event)
        self._pending.clear()
        self._bets.clear()
