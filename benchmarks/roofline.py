"""The decode step's roofline floor (issue 22): the least time a step can take given the bytes it must move.

    floor = (weight bytes read + KV and indexer-key bytes read) / HBM bandwidth + miss bytes / PCIe bandwidth

Both bandwidths are measured in the benchmark's own process by a copy (`measure_bandwidths`): a device → device
copy for HBM (counted as bytes read + bytes written per second, what the memory moves) and a pinned host → device
copy for PCIe. The two terms are added, not overlapped: a step whose swap-in hides behind other work can run
below the floor's PCIe share, which step / floor then shows as < 1 on HBM terms alone.

What a decode step of `batch` requests at `context` tokens reads (the model's weights as stored, counted from the
built model's storages by `weight_split`):
  - every weight of attention (MLA projections, absorbed W_UK / W_UV, indexer projections), dense MLPs, shared
    experts, routers, norms and the LM head, once per step whatever the batch;
  - not `kv_b_proj`: decode runs the absorbed form, which reads W_UK / W_UV instead;
  - of the embedding table only the `batch` rows looked up;
  - of each MoE layer's routed experts only those some token of the batch activates. Assumption (documented in
    docs/benchmarks.md): each token picks `top_k` of the layer's `E` local experts, every expert equally likely
    and tokens independent (random weights and random inputs make it so: the router's bias is tiny and the same
    for every expert in expectation), so the expected number of distinct experts a batch activates is
    E · (1 − (1 − top_k / E) ** batch). Correlation between a token's own choices (group-limited routing) does not
    change this expectation, which is a sum over experts of P(some token picks it).
  - KV: per request and layer, the top-k rows attention reads (min(index_topk, context) rows of `row_bytes`) and,
    on layers that run the indexer, the indexer key of every context token (`index_key_bytes`: 128 FP8 values and
    an fp32 scale). Dense and HiSparse read the same bytes from HBM; HiSparse also brings its misses over PCIe.

Pure arithmetic except `weight_split` (walks a model) and `measure_bandwidths` (times copies); unit-tested on CPU
in tests/engine/test_roofline.py.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

GB = 1e9


@dataclass(frozen=True)
class WeightSplit:
    """A model's weight bytes by how much of them a decode step reads."""

    fixed: int  # read whole every step: attention, dense MLPs, shared experts, routers, norms, LM head
    routed_expert: int  # one routed expert of one MoE layer (its gate/up/down weights and block scales)
    moe_layers: int
    experts_per_layer: int  # local routed experts of each MoE layer
    experts_per_token: int  # top_k of the router
    embedding_row: int  # one row of the input embedding (one per request per step)
    vocab_rows: int  # rows of the embedding table
    unread: int  # stored but not read by a decode step (kv_b_proj: decode reads the absorbed W_UK / W_UV)

    @property
    def total(self) -> int:
        """Bytes of every weight counted, read or not (equals the model's stored weight bytes)."""
        return (self.fixed + self.routed_expert * self.moe_layers * self.experts_per_layer
                + self.embedding_row * self.vocab_rows + self.unread)

    def to_json(self) -> dict[str, int]:
        return asdict(self)


def expected_active_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts `batch` tokens activate when each picks `top_k` of `num_experts` uniformly:
    E · (1 − (1 − k/E)^B)."""
    if num_experts <= 0 or top_k <= 0 or batch <= 0:
        return 0.0
    if top_k > num_experts:
        raise ValueError(f"top_k {top_k} exceeds the {num_experts} experts")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def weight_bytes_read(split: WeightSplit, batch: int) -> float:
    """Weight bytes one decode step of `batch` requests reads (expected value: the routed experts' share)."""
    active = expected_active_experts(split.experts_per_layer, split.experts_per_token, batch)
    return split.fixed + split.embedding_row * batch + split.routed_expert * split.moe_layers * active


def kv_bytes_read(batch: int, context: int, num_layers: int, num_index_layers: int, index_topk: int,
                  row_bytes: int, index_key_bytes: int) -> int:
    """KV and indexer-key bytes one decode step reads: per request, the top-k rows of every layer and the indexer
    keys of every context token on the layers that run the indexer."""
    rows = min(index_topk, context)
    return batch * (num_layers * rows * row_bytes + num_index_layers * context * index_key_bytes)


@dataclass(frozen=True)
class Floor:
    """A step's floor and its parts (seconds and bytes)."""

    weight_bytes: float
    kv_bytes: int
    miss_bytes: float
    hbm_s: float
    pcie_s: float

    @property
    def seconds(self) -> float:
        return self.hbm_s + self.pcie_s


def step_floor(weight_bytes: float, kv_bytes: int, miss_bytes: float, hbm_gbps: float, pcie_gbps: float) -> Floor:
    """(weight + KV bytes) / HBM bandwidth + miss bytes / PCIe bandwidth (bandwidths in GB/s, 1e9 B/s)."""
    if hbm_gbps <= 0 or (miss_bytes > 0 and pcie_gbps <= 0):
        raise ValueError(f"bandwidths must be positive (HBM {hbm_gbps} GB/s, PCIe {pcie_gbps} GB/s)")
    hbm_s = (weight_bytes + kv_bytes) / (hbm_gbps * GB)
    pcie_s = miss_bytes / (pcie_gbps * GB) if miss_bytes > 0 else 0.0
    return Floor(weight_bytes=weight_bytes, kv_bytes=kv_bytes, miss_bytes=miss_bytes, hbm_s=hbm_s, pcie_s=pcie_s)


# -- from a model ------------------------------------------------------------------------------------------------

def weight_split(model: torch.nn.Module) -> WeightSplit:
    """Classify a built model's weight storages (decode_server/model/weights.py `weight_storages`: each storage
    once, the experts' stacked storage under its first expert's name) by what a decode step reads. A shared expert
    fused into the stacks (decode_server/model/moe.py) lives in that storage but is read every step: its bytes
    count as fixed."""
    from decode_server.model.moe import MoE
    from decode_server.model.weights import weight_storages

    config = model.config
    fixed = routed = unread = embedding = 0
    for name, _kind, nbytes in weight_storages(model):
        if ".mlp.experts." in name:
            routed += nbytes
        elif ".kv_b_proj." in name:
            unread += nbytes
        elif name.endswith("embed_tokens.weight"):
            embedding += nbytes
        else:
            fixed += nbytes
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in moes:
        if moe.fuses_shared:
            shared = sum(t.numel() * t.element_size() for t in moe.shared_experts.parameters())
            routed, fixed = routed - shared, fixed + shared
    experts = len(moes[0].local_experts()) if moes else 0
    if moes and any(len(m.local_experts()) != experts for m in moes):
        raise ValueError("MoE layers hold different numbers of local experts")
    vocab = int(config.vocab_size)
    per_expert = routed // (len(moes) * experts) if moes and experts else 0
    split = WeightSplit(fixed=fixed, routed_expert=per_expert, moe_layers=len(moes), experts_per_layer=experts,
                        experts_per_token=int(config.num_experts_per_tok) if moes else 0,
                        embedding_row=embedding // vocab, vocab_rows=vocab, unread=unread)
    if routed != per_expert * len(moes) * experts or embedding != split.embedding_row * vocab:
        raise ValueError("routed expert or embedding storages do not split evenly")
    return split


# -- bandwidths --------------------------------------------------------------------------------------------------

def _cpu_copy_gbps(num_bytes: int, iters: int) -> float:
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(iters):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * num_bytes / best / GB


def measure_bandwidths(device: torch.device, hbm_bytes: int = 1 << 30, pcie_bytes: int = 256 << 20,
                       iters: int = 5) -> dict[str, float | str]:
    """HBM and PCIe bandwidths (GB/s) by copies in this process: device → device (bytes read + written per
    second) and pinned host → device. On a CPU both are a host memcpy (the smoke run's floor is only arithmetic
    checked end to end, not a hardware claim)."""
    if device.type == "cuda":
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _timing import hbm_copy_gbps, pinned_h2d_gbps

        with torch.cuda.device(device):
            hbm = hbm_copy_gbps(hbm_bytes, iters)
            pcie = pinned_h2d_gbps(pcie_bytes, iters)
        torch.cuda.empty_cache()
        return {"hbm_gbps": hbm, "pcie_gbps": pcie, "hbm_method": "device->device copy_ (read+write bytes)",
                "pcie_method": "pinned host->device copy_"}
    gbps = _cpu_copy_gbps(min(hbm_bytes, 64 << 20), iters)
    return {"hbm_gbps": gbps, "pcie_gbps": gbps, "hbm_method": "cpu memcpy", "pcie_method": "cpu memcpy"}
