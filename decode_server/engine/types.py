"""Values the engine hands to its callers (offline `LLM`, the engine process): token deltas and stats.

Kept free of torch so the API process can import them without touching the device.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

FinishReason = Literal["stop", "length", "abort"]


class TokenLogprob(BaseModel):
    """Log-probability of one generated token and, when asked for, the best alternatives at that step."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = Field(default_factory=list)


class RequestDelta(BaseModel):
    """What one engine step produced for one request.

    `new_token_ids` are the tokens sampled this step (at most one in this engine; a list so that speculative
    decoding can extend it). `text` is the newly detokenized text (stop strings already cut off); the API may
    use it or run its own detokenizer. When `finished` is true, the request's memory is already freed.
    """

    rid: str
    new_token_ids: list[int] = Field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = Field(
        default=None, description="the stop string or stop token id that ended the request, if any"
    )
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = Field(default=0, description="prompt tokens whose KV came from the prefix cache")
    logprobs: list[TokenLogprob] | None = None
    # params.prompt_logprobs: on the request's first delta, one entry per prompt token (the first is None)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None
    error_class: str | None = Field(
        default=None, description="a decode_server.errors class name: the request failed; the API reports it"
    )


class HiSparseLayerStats(BaseModel):
    """Cumulative swap-in counters of one layer since the engine started."""

    layer: int
    hits: int = 0
    misses: int = 0
    # The speculative prefetch's swap-ins into this layer (HiSparseConfig.speculative_prefetch): rows its bets
    # found in the buffer and rows they copied (in bytes_h2d too); not in hits / misses.
    speculative_hits: int = 0
    speculative_misses: int = 0
    # Rows this layer's own swap-ins did not copy thanks to the bets: its first shared follower's misses − its own
    # (decode_server/hisparse/prefetch.py rows_saved_by_bets); None where the layer receives no bets or has no
    # shared follower to compare with.
    speculative_rows_saved: int | None = None
    bytes_h2d: int = 0
    bytes_d2h: int = 0


class PoolUsage(BaseModel):
    """Units used / total of one memory pool (host pages, device slots, indexer slots, dense KV slots)."""

    used: int = 0
    total: int = 0

    @property
    def fraction(self) -> float:
        return self.used / self.total if self.total else 0.0


class PrefixCacheStats(BaseModel):
    """Prefix caching (decode_server/engine/prefix_cache.py): what the cache holds and how often prompts hit it."""

    cached_tokens: int = Field(default=0, description="tokens whose KV pages the cache holds")
    evictable_tokens: int = Field(default=0, description="of those, tokens no request maps (freed when needed)")
    queried_tokens: int = Field(default=0, description="prompt tokens of requests admitted so far (monotonic)")
    hit_tokens: int = Field(default=0, description="of those, tokens found cached and not recomputed (monotonic)")
    evicted_tokens: int = Field(default=0, description="tokens evicted to make room or flushed (monotonic)")
    page_size: int = Field(default=0, description="tokens per cached page")

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


# Upper bounds (seconds) of the PD transfer-latency histogram buckets.
KV_TRANSFER_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class DisaggStats(BaseModel):
    """PD disaggregation counters of one server (decode_server/disagg/; prefill or decode role)."""

    mode: str = "null"
    num_bootstrapping_reqs: int = Field(default=0, description="prefill: waiting for decode's destination")
    num_inflight_reqs: int = Field(default=0, description="prefill: computed, KV held until its transfer ends")
    num_transferring_reqs: int = Field(default=0, description="decode: admitted, waiting for its KV")
    num_prealloc_reqs: int = Field(default=0, description="decode: waiting for memory before its destination")
    rooms_by_state: dict[str, int] = Field(default_factory=dict, description="rooms in flight by state")
    rooms_finished: dict[str, int] = Field(default_factory=dict, description="ended rooms by terminal state")
    failures_by_cause: dict[str, int] = Field(default_factory=dict)
    transfer_bytes: int = 0
    latency_bucket_counts: list[int] = Field(default_factory=list, description="per KV_TRANSFER_LATENCY_BUCKETS, "
                                             "then +Inf; not cumulative")
    latency_sum_s: float = 0.0
    latency_count: int = 0
    staging_rows: PoolUsage = Field(default_factory=PoolUsage)
    aux_rows_used: int = 0
    registered_bytes: int = Field(default=0, description="memory registered with the transfer engine")
    rejected_by_reason: dict[str, int] = Field(
        default_factory=dict, description="control messages and bootstrap requests refused, by reason")
    auth: bool = Field(default=False, description="the PD control plane is authenticated (a cluster secret)")


class TPRankStats(BaseModel):
    """One tensor-parallel rank's view, gathered by rank 0 at each stats query: every rank runs the same scheduler
    on the same messages, so all of them must match rank 0's (tests compare them)."""

    tp_rank: int
    pid: int
    num_steps: int = 0
    num_generated_tokens: int = 0
    token_digest: str = Field(default="", description="running hash of every (rid, tokens) delta this rank produced")
    host_pages_used: int = 0
    device_slots_used: int = 0
    indexer_slots_used: int = 0
    dense_kv_slots_used: int = 0
    pd_staging_rows_used: int = Field(default=0, description="PD decode: staging rows this rank holds (shared memory)")


class DPRankStats(BaseModel):
    """One data-parallel-attention rank's load and memory, gathered by rank 0 at each stats query (each rank serves
    its own requests: /metrics reports them per `dp_rank`)."""

    dp_rank: int
    pid: int
    num_running_reqs: int = 0
    num_queue_reqs: int = 0
    num_retracted_reqs: int = 0
    token_usage: float = 0.0
    num_steps: int = Field(default=0, description="passes with this rank's tokens")
    num_idle_passes: int = Field(default=0, description="passes run without a token of its own")
    num_generated_tokens: int = 0
    host_pages: PoolUsage = Field(default_factory=PoolUsage)
    device_slots: PoolUsage = Field(default_factory=PoolUsage)
    indexer_slots: PoolUsage = Field(default_factory=PoolUsage)
    dense_kv_slots: PoolUsage = Field(default_factory=PoolUsage)
    kv_transfer_bytes: int = Field(default=0, description="PD decode: KV bytes that arrived into this rank")


class EngineStats(BaseModel):
    """A snapshot for the metrics layer (names follow SGLang where one exists)."""

    num_running_reqs: int = 0
    num_queue_reqs: int = 0
    num_retracted_reqs: int = 0
    token_usage: float = Field(default=0.0, description="fraction of the binding KV pool in use")
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0
    num_steps: int = 0
    num_retractions: int = 0
    num_idle_passes: int = Field(default=0, description="DP attention: passes run without a token of this rank's")
    hisparse_enabled: bool = False
    hisparse_layers: list[HiSparseLayerStats] = Field(default_factory=list)
    host_pages: PoolUsage = Field(default_factory=PoolUsage)
    device_slots: PoolUsage = Field(default_factory=PoolUsage)
    indexer_slots: PoolUsage = Field(default_factory=PoolUsage)
    dense_kv_slots: PoolUsage = Field(default_factory=PoolUsage)
    prefix_cache: PrefixCacheStats | None = Field(default=None, description="None: prefix caching is off")
    quantization: str = Field(default="none", description="'fp8': block-FP8 weights kept in FP8; 'none': dequantized")
    weights_bytes: int = Field(default=0, description="device bytes the model's weights hold (this rank's with TP)")
    weights_bytes_by_kind: dict[str, int] = Field(
        default_factory=dict, description="fp8 weights, fp8_scales, absorbed (MLA W_UK/W_UV), other")
    disagg: DisaggStats | None = None
    tp_ranks: list[TPRankStats] = Field(default_factory=list, description="per rank with --tp-size > 1; else empty")
    device_kv_budget_bytes: int = Field(default=0, description="the device KV budget the pools were sized from")
    host_kv_budget_bytes: int = Field(default=0, description="the HiSparse host pool budget (0: dense)")
    dp_ranks: list[DPRankStats] = Field(
        default_factory=list, description="per rank with --enable-dp-attention (the totals above sum them); else empty")

    @property
    def hisparse_hits(self) -> int:
        return sum(s.hits for s in self.hisparse_layers)

    @property
    def hisparse_misses(self) -> int:
        return sum(s.misses for s in self.hisparse_layers)

    @property
    def bytes_h2d(self) -> int:
        return sum(s.bytes_h2d for s in self.hisparse_layers)

    @property
    def bytes_d2h(self) -> int:
        return sum(s.bytes_d2h for s in self.hisparse_layers)


class GenerationOutput(BaseModel):
    """The offline API's result for one prompt."""

    prompt: str | None = None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # SamplingParams.prompt_logprobs
