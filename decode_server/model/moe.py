"""DeepSeek-V3 mixture of experts: grouped top-k routing with sigmoid scores and a selection-only bias.

Routing ("noaux_tc"): scores = sigmoid(router logits). Selection uses `scores + e_score_correction_bias`:
experts are split into `n_group` groups, each group is rated by the sum of its two best biased scores, the best
`topk_group` groups survive, and the `num_experts_per_tok` best biased scores among their experts are chosen.
The mixing weights are the *unbiased* scores of the chosen experts, renormalized to sum to 1 when
`norm_topk_prob`, then multiplied by `routed_scaling_factor`. Shared experts see every token.

With tensor parallelism the gate is replicated (every rank routes every token identically) and the shared
experts are tensor-sharded. Routed experts are either tensor-sharded too (ep_size 1: every rank holds a slice of
every expert) or split whole across the ranks (ep_size == tp_size: rank r holds experts [r·E/N, (r+1)·E/N) and
computes only the choices that fall on them, for all tokens). Either way every rank ends with a partial sum of
the layer's output and one all-reduce of [T, hidden] combines them: since attention is tensor-parallel, every
rank already has every token, so expert parallelism needs no token dispatch. With data-parallel attention each
rank owns different tokens: the decoder layer gathers every rank's tokens before the MoE and reduce-scatters its
partial output back to the owners instead (`reduce=False` here; decode_server/parallel/dp_attention.py).

Shared-experts fusion (SGLang's, `--disable-shared-experts-fusion` turns it off): where the shared expert has the
routed experts' shapes (DeepSeek-V3.2 and GLM-5: one shared expert of `moe_intermediate_size`, at TP1 or tensor-
sharded like the experts; not with expert parallelism, where the experts are whole and the shared one is sharded),
its weights are one more expert of the stacks, [E+1, 2I, H] and [E+1, H, I], and every token one more choice of
it. At decode a MoE layer then launches two grouped GEMMs instead of two grouped and two dense ones, and the shared
expert's bytes ride the grouped launches' read rate (a 29 MB dense launch alone reaches ~59 % of the H200's copy
rate, docs/benchmarks.md). Block-FP8 experts on a GPU only, and only where the GPU's FP8 table has the E+1 shapes
(`grouped_shape_tuned`): the bf16 experts run torch's grouped GEMM, which was not measured for it.
"""

from __future__ import annotations

import torch
from torch import nn

from decode_server.model import batch_invariant, fused_ops
from decode_server.model.config import ModelConfig
from decode_server.model.layers import MLP, narrow_linear
from decode_server.parallel.comm import all_reduce
from decode_server.parallel.layers import split_size
from decode_server.parallel.state import ParallelState, resolve
from kernels.fp8_gemm import SharedInput, fp8_grouped_linear, grouped_shape_tuned

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# (stacked weight, stacked FP8 block scales or None) for gate, up, down.
Stacked = tuple[tuple[torch.Tensor, torch.Tensor | None], ...]


_shared_experts_fusion = True


def set_shared_experts_fusion(enabled: bool) -> None:
    """Whether MoE layers built from now on may fuse their shared expert into the routed stacks (module
    docstring); the engine sets it from `--disable-shared-experts-fusion` before it builds the model."""
    global _shared_experts_fusion
    _shared_experts_fusion = bool(enabled)


def shared_experts_fusion() -> bool:
    return _shared_experts_fusion


def _one_storage(params: list[list[torch.Tensor]], copy: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """params[j][e]: projection j's tensor of expert e (same trailing dims) → (one [E, Σ rows_j, ...] storage, each
    projection's [E, rows_j, ...] view of it); every expert's parameter becomes its view's slice. copy: the storage
    takes the current values; else it is left undefined for the caller to fill (the loader)."""
    experts = len(params[0])
    first = params[0][0]
    rows = [group[0].shape[0] for group in params]
    if copy:
        whole = torch.stack([torch.cat([group[e].detach() for group in params]) for e in range(experts)])
    else:
        whole = torch.empty((experts, sum(rows), *first.shape[1:]), dtype=first.dtype, device=first.device)
    parts, start = [], 0
    for group, count in zip(params, rows, strict=True):
        part = whole[:, start : start + count]
        for e, param in enumerate(group):
            param.data = part[e]
        parts.append(part)
        start += count
    return whole, parts


def route_tokens(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    n_group: int,
    topk_group: int,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] float32 logits → (weights [T, top_k] float32, expert ids [T, top_k] int64)."""
    num_tokens, num_experts = router_logits.shape
    scores = torch.sigmoid(router_logits.float())
    biased = scores + correction_bias.float()
    if n_group > 1:
        grouped = biased.view(num_tokens, n_group, num_experts // n_group)
        group_rating = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # [T, G]
        kept_groups = group_rating.topk(topk_group, dim=-1).indices
        group_keep = torch.zeros_like(group_rating, dtype=torch.bool).scatter_(1, kept_groups, True)
        expert_keep = group_keep.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        biased = biased.masked_fill(~expert_keep, float("-inf"))
    expert_ids = biased.topk(top_k, dim=-1).indices
    weights = scores.gather(1, expert_ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, expert_ids


# Choices (tokens × experts per token) up to which the MoE's dispatch and combine run as one kernel each
# (kernels/moe_dispatch_triton.py: each dispatch program counts over all choices, O(n²)): 512 tokens at top-8.
MOE_DISPATCH_MAX_CHOICES = 4096


def moe_dispatch_supported(x: torch.Tensor, expert_ids: torch.Tensor) -> bool:
    """Whether `MoE.routed_dispatched` applies: CUDA rows with a contiguous last dim, decode-sized batches."""
    return (x.is_cuda and x.dim() == 2 and x.stride(-1) == 1 and expert_ids.dim() == 2
            and expert_ids.shape[0] == x.shape[0] and 0 < expert_ids.numel() <= MOE_DISPATCH_MAX_CHOICES)


def expert_end_offsets(sorted_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """End offset of each expert's run in expert ids sorted ascending ([E] int32, = cumsum of the counts).

    A sorted search with a fixed-size output stays on the device; `torch.bincount` would read the ids' max on
    the host first (a sync per MoE layer on CUDA)."""
    experts = torch.arange(num_experts, device=sorted_ids.device, dtype=sorted_ids.dtype)
    return torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)


class MoEGate(nn.Module):
    """Router weights (kept in float32) and the per-expert selection bias."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config

        def route(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = narrow_linear(rows, self.weight.float())
            args = (self.e_score_correction_bias, c.n_group, c.topk_group, c.num_experts_per_tok, c.norm_topk_prob,
                    c.routed_scaling_factor)
            if fused_ops.router_enabled() and logits.is_cuda:
                from kernels import moe_route_triton  # imports triton: CUDA only

                if moe_route_triton.supports(logits, c.n_group, c.topk_group, c.num_experts_per_tok):
                    return moe_route_triton.route(logits, *args)  # one kernel instead of ~15 (its docstring)
            return route_tokens(logits, *args)

        if batch_invariant.enabled():
            return batch_invariant.on_row_tiles_pair(route, x.float())  # the routing, not only its GEMM, on tiles
        return route(x.float())


class MoE(nn.Module):
    """Routed experts + shared experts.

    On CUDA the routed experts run as grouped GEMMs over the tokens sorted by expert — [gate ; up] as one where
    they share a stack (`gate_up_stack`), then down — (`torch._grouped_mm` with offsets found on the device by a
    sorted search, `expert_end_offsets`; block-FP8 experts: the Triton grouped FP8 GEMM of kernels/fp8_gemm.py,
    the activations quantized once for gate and up when they run apart), so a forward never
    waits for the GPU to learn how many tokens each expert got; the per-token results are summed in a fixed order
    (no atomics), so the output is deterministic.
    Elsewhere (CPU) a loop over the experts that received tokens, with one host sync per call.
    """

    def __init__(self, config: ModelConfig, parallel: ParallelState | None = None, reduce: bool = True) -> None:
        super().__init__()
        parallel = resolve(parallel)
        self.parallel = parallel
        self.reduce = reduce  # False: return this rank's partial sum (the caller combines the ranks' partials)
        self.num_experts = config.n_routed_experts
        self.gate = MoEGate(config)
        self.experts: nn.ModuleList | nn.ModuleDict
        if parallel.expert_parallel:
            # This rank's experts, whole, under their global ids (checkpoint names `experts.E.*`).
            per_rank = split_size(config.n_routed_experts, parallel.ep_size, "n_routed_experts (expert parallel)")
            self.first_expert = parallel.ep_rank * per_rank
            self.num_local_experts = per_rank
            self.experts = nn.ModuleDict(
                (str(e), MLP(config.hidden_size, config.moe_intermediate_size, stack_gate_up=False))
                for e in range(self.first_expert, self.first_expert + per_rank)
            )
        else:
            self.first_expert = 0
            self.num_local_experts = config.n_routed_experts
            self.experts = nn.ModuleList(
                MLP(config.hidden_size, config.moe_intermediate_size, parallel, reduce=False,
                    what="moe_intermediate_size", stack_gate_up=False)
                for _ in range(config.n_routed_experts)
            )
        self.shared_experts = MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts,
                                  parallel, reduce=False, what="moe_intermediate_size × n_shared_experts")
        self._stacked: Stacked | None = None
        self._gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None  # `gate_up_stack`
        # The shared expert is the stacks' last expert (`stack_experts` decides; module docstring).
        self.fuses_shared = False
        # Plain tuple (not registered twice): the modules stay the same objects through .to() / to_empty().
        self._local_experts = tuple(
            self.experts.values() if isinstance(self.experts, nn.ModuleDict) else self.experts
        )

    def local_experts(self) -> tuple[nn.Module, ...]:
        """This rank's experts in id order (all of them unless experts are split across ranks)."""
        return self._local_experts

    def local_choices(self, expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert parallel: (ids relative to this rank's first expert, with `num_local_experts` — a sentinel
        that sorts last and that no loop or grouped GEMM reaches — for other ranks' experts; owned mask)."""
        local = expert_ids - self.first_expert
        owned = (local >= 0) & (local < self.num_local_experts)
        return torch.where(owned, local, self.num_local_experts), owned

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.gate(x)
        owned: torch.Tensor | None = None
        if self.parallel.expert_parallel:
            expert_ids, owned = self.local_choices(expert_ids)
        # Batch-invariant mode runs the experts one by one on fixed row tiles (decode_server/model/batch_invariant.py).
        fp8 = self.fp8_experts()
        grouped_ok = not batch_invariant.enabled() and (fp8 or hasattr(torch, "_grouped_mm"))
        if x.is_cuda and (fp8 or x.dtype == torch.bfloat16) and grouped_ok:
            if self.fuses_shared:  # the shared expert runs in the grouped GEMMs as each token's last choice
                if moe_dispatch_supported(x, expert_ids):
                    out = self.routed_dispatched(x, weights, expert_ids)
                else:
                    out = self.routed_grouped(x, weights, expert_ids, owned)
            elif moe_dispatch_supported(x, expert_ids):  # decode's token counts: one dispatch and one combine kernel
                out = self.routed_dispatched(x, weights, expert_ids, self.shared_experts(x))
            else:
                out = self.routed_grouped(x, weights, expert_ids, owned) + self.shared_experts(x)
        else:
            out = self.routed_loop(x, weights, expert_ids) + self.shared_experts(x)
        # Partial sums on every rank with tensor/expert parallelism: one all-reduce (a no-op on one device).
        return all_reduce(out, self.parallel) if self.reduce else out

    def routed_loop(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        top_k = expert_ids.shape[1]
        flat_ids = expert_ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        # Expert parallel: other ranks' choices carry the sentinel id num_local_experts, sorted last, never run.
        counts = torch.bincount(flat_ids, minlength=self.num_local_experts).tolist()[: self.num_local_experts]
        token_of = order // top_k
        weight_of = weights.flatten()[order]
        routed = torch.zeros_like(x)
        experts = self.local_experts()
        start = 0
        for expert_id, count in enumerate(counts):
            if count == 0:
                continue
            tokens = token_of[start : start + count]
            out = experts[expert_id](x[tokens]) * weight_of[start : start + count, None]
            routed.index_add_(0, tokens, out.to(routed.dtype))
            start += count
        return routed

    def fp8_input_shape(self) -> tuple[int, int] | None:
        """(N, K) of the shared experts' block-FP8 gate+up GEMM, which reads the MoE's input as it is (the routed
        experts read its rows in expert order: a gathered copy)."""
        return self.shared_experts.fp8_input_shape()

    def fp8_experts(self) -> bool:
        """Whether the routed experts' weights are stored in block FP8."""
        return self.local_experts()[0].gate_proj.fp8_scale is not None

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert weights as [E, I, H] gate/up and [E, H, I] down (`stacked` without the scales)."""
        (gate, _), (up, _), (down, _) = self.stacked()
        return gate, up, down

    def stacked(self) -> Stacked:
        """(weights, FP8 block scales or None) per projection, stacked over the experts, [E, I, H] gate/up and
        [E, H, I] down. Built at model construction (`stack_experts`), else on first use by copying; either way
        each expert's parameters are views into the stacks, so memory is not doubled. Rebuilt if the experts
        moved to another device (`.to()` replaces the views). Where gate and up share one storage
        (`gate_up_stack`) their stacks are views of it."""
        experts = self.local_experts()
        device = experts[0].gate_proj.weight.device
        if self._stacked is None or self._stacked[0][0].device != device or any(
                getattr(experts[0], name).weight.untyped_storage().data_ptr()
                != stacked.untyped_storage().data_ptr() for name, (stacked, _) in zip(_PROJECTIONS, self._stacked,
                                                                                       strict=True)):
            self._stacked = self._stack(copy=True)
        return self._stacked

    def gate_up_stack(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The experts' gate and up as one [E, 2I, H] stack (gate rows first; FP8 scales [E, 2I/128, H/128]), which
        `expert_mlps` multiplies in one grouped GEMM, or None where they are kept apart (`_joins_gate_up`)."""
        self.stacked()
        return self._gate_up

    def grouped_gemms(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The (weights, scales) stacks `expert_mlps` multiplies: [gate ; up] and down, or gate, up and down."""
        (gate, up, down), joint = self.stacked(), self._gate_up
        return [joint, down] if joint is not None else [gate, up, down]

    def stack_experts(self) -> None:
        """Give each expert projection (and its FP8 scales) one stacked storage now — gate and up one together
        where `_joins_gate_up`, the shared expert as the last expert where `_can_fuse_shared` — the experts'
        parameters becoming views with undefined values: the caller fills them (model construction, before
        loading)."""
        self.fuses_shared = self._can_fuse_shared()
        if self.fuses_shared:  # its gate and up are rows of the joined stack: no stack of its own
            self.shared_experts.stack_gate_up = False
            self.shared_experts.fused_gate_up = None
        self._stacked = self._stack(copy=False)

    def stack_members(self) -> tuple[nn.Module, ...]:
        """The MLPs whose weights the stacks hold, in stack order: this rank's experts, then the shared expert
        where it is fused."""
        experts = self.local_experts()
        return (*experts, self.shared_experts) if self.fuses_shared else experts

    def _can_fuse_shared(self) -> bool:
        """Shared-experts fusion applies (module docstring): switched on, no expert parallelism, block-FP8
        experts off the CPU, the shared expert's projections of the experts' shapes, dtype and blocks, gate rows in
        whole blocks (gate and up join), and on a GPU in table mode both E+1 grouped shapes in its table."""
        if not _shared_experts_fusion or self.parallel.expert_parallel:
            return False
        expert, shared = self.local_experts()[0], self.shared_experts
        gate = expert.gate_proj
        if gate.fp8_scale is None or gate.weight.device.type == "cpu":
            return False
        for name in _PROJECTIONS:
            mine, theirs = getattr(shared, name), getattr(expert, name)
            if (mine.weight.shape != theirs.weight.shape or mine.weight.dtype != theirs.weight.dtype
                    or mine.fp8_scale is None or tuple(mine.weight_block) != tuple(theirs.weight_block)
                    or mine.bias is not None or theirs.bias is not None):
                return False
        if gate.weight.shape[0] % gate.weight_block[0]:
            return False
        rows, hidden = gate.weight.shape
        members = self.num_local_experts + 1
        return (grouped_shape_tuned(2 * rows, hidden, members, gate.weight.device)
                and grouped_shape_tuned(hidden, rows, members, gate.weight.device))

    @staticmethod
    def _joins_gate_up(experts: tuple[nn.Module, ...]) -> bool:
        """Whether gate and up share one [E, 2I, H] stack and run as one grouped GEMM: half the launches and twice
        the bytes a launch (at decode a launch's fixed cost is a large share of its time). Block FP8 needs gate's
        rows in whole scale blocks, and on a GPU in table mode a tuned choice for the [2I, H] shape, so as not to
        trade two tuned GEMMs for an untimed default (`benchmarks/tune_fp8_gemm.py` measures it: measure mode
        joins)."""
        gate = experts[0].gate_proj
        if gate.fp8_scale is None:
            return True
        if gate.weight.shape[0] % gate.weight_block[0]:
            return False
        return grouped_shape_tuned(2 * gate.weight.shape[0], gate.weight.shape[1], len(experts), gate.weight.device)

    def _stack(self, copy: bool) -> Stacked:
        experts = self.stack_members()
        joins = self._joins_gate_up(experts)
        groups = (("gate_proj", "up_proj"), ("down_proj",)) if joins else tuple((name,) for name in _PROJECTIONS)
        views: dict[str, list[torch.Tensor | None]] = {name: [] for name in _PROJECTIONS}
        self._gate_up = None
        for names in groups:
            wholes: list[torch.Tensor | None] = []
            for attr in ("weight", "weight_scale_inv"):
                params = [[getattr(e, name)._parameters.get(attr) for e in experts] for name in names]
                if params[0][0] is None:
                    wholes.append(None)
                    for name in names:
                        views[name].append(None)
                    continue
                whole, parts = _one_storage(params, copy)
                wholes.append(whole)
                for name, part in zip(names, parts, strict=True):
                    views[name].append(part)
            if joins and len(names) == 2:
                self._gate_up = (wholes[0], wholes[1])  # type: ignore[assignment]
        return tuple((views[name][0], views[name][1]) for name in _PROJECTIONS)  # type: ignore[return-value]

    def expert_mlps(self, xs: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The routed experts' MLPs over rows sorted by expert (expert e owns rows up to offsets[e]): grouped GEMMs
        (gate and up as one where they share a stack) → [rows, hidden]; rows past offsets[-1] are undefined."""
        (gate_w, gate_s), (up_w, up_s), (down_w, down_s) = self.stacked()
        joint = self._gate_up
        if gate_s is not None:
            block = self.local_experts()[0].gate_proj.weight_block
            if joint is not None:
                both = fp8_grouped_linear(xs, joint[0], joint[1], offsets, block)
                gate, up = both.split(gate_w.shape[1], dim=-1)
            else:
                shared = SharedInput(xs)  # gate and up read one quantization, made only if their kernels need it
                gate = fp8_grouped_linear(xs, gate_w, gate_s, offsets, block, shared)
                up = fp8_grouped_linear(xs, up_w, up_s, offsets, block, shared)
            return fp8_grouped_linear(fused_ops.silu_mul(gate, up), down_w, down_s, offsets, block)
        # grouped_mm(a [M, K], b [E, K, N]): the transposed views make each expert's weight column-major.
        if joint is not None:
            gate, up = torch._grouped_mm(xs, joint[0].transpose(1, 2), offs=offsets).split(gate_w.shape[1], dim=-1)
        else:
            gate = torch._grouped_mm(xs, gate_w.transpose(1, 2), offs=offsets)
            up = torch._grouped_mm(xs, up_w.transpose(1, 2), offs=offsets)
        return torch._grouped_mm(fused_ops.silu_mul(gate, up), down_w.transpose(1, 2), offs=offsets)

    def routed_dispatched(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                          shared: torch.Tensor | None = None) -> torch.Tensor:
        """`routed_grouped` + `shared` with the dispatch and the combine as one kernel each
        (kernels/moe_dispatch_triton.py): the grouped GEMMs see the rows the sort gives, in its order. With a
        fused shared expert (`shared` None) the dispatch adds each token's shared choice and the combine its row."""
        from kernels import moe_dispatch_triton  # imports triton: CUDA only

        fused = self.fuses_shared
        members = self.num_local_experts + int(fused)
        xs, slot, offsets = moe_dispatch_triton.dispatch(x, expert_ids, members, shared_expert=fused)
        out_sorted = self.expert_mlps(xs, offsets)
        return moe_dispatch_triton.combine(out_sorted, slot, expert_ids, weights.contiguous(), members,
                                           shared=shared, out_dtype=x.dtype, shared_in_ys=fused)

    def routed_grouped(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                       owned: torch.Tensor | None = None) -> torch.Tensor:
        """`owned` (expert parallel): which choices fall on this rank; the others (sentinel ids, past the last
        offset, so their rows of the grouped GEMM output are undefined) are zeroed before the weighted sum."""
        num_tokens, top_k = expert_ids.shape
        fused = self.fuses_shared  # each token's last choice is the shared expert (the stacks' last)
        choices = torch.cat([expert_ids, expert_ids.new_full((num_tokens, 1), self.num_local_experts)], dim=1) \
            if fused else expert_ids
        per_token = choices.shape[1]
        sorted_ids, order = torch.sort(choices.flatten(), stable=True)
        offsets = expert_end_offsets(sorted_ids, self.num_local_experts + int(fused))
        out_sorted = self.expert_mlps(x[order // per_token], offsets)
        per_choice = torch.empty_like(out_sorted)
        per_choice[order] = out_sorted
        per_choice = per_choice.view(num_tokens, per_token, -1).float()
        shared = per_choice[:, top_k] if fused else None
        per_choice = per_choice[:, :top_k]
        if owned is not None:
            per_choice = torch.where(owned.unsqueeze(-1), per_choice, 0.0)
        per_choice = per_choice * weights.unsqueeze(-1)
        routed = per_choice.sum(dim=1).to(x.dtype)
        return routed if shared is None else (routed.float() + shared).to(x.dtype)
