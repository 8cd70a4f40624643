"""Token sampling: greedy, temperature, top-k, top-p, each request with its own seeded generator.

Per-request generators make a request's tokens depend only on its own seed and logits, never on which other
requests share the batch, so results are reproducible under continuous batching. The generator is re-seeded
before every token from (request seed, index of the token in the output) — counter-based, as JAX's and
Philox's keyed streams are — so token i does not depend on how many random draws came before it in this
process: a PD decode server, which starts at output token 1 (the prefill server sampled token 0), samples what a
colocated server would, and a retracted-and-resumed request cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from decode_server.engine.sampling_params import SamplingParams
from decode_server.engine.types import TokenLogprob

# Temperatures below this sample like greedy: dividing logits by less overflows float32 and makes NaN probabilities.
MIN_TEMPERATURE = 1e-5


def is_greedy(params: SamplingParams) -> bool:
    return params.is_greedy or params.temperature < MIN_TEMPERATURE


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


_MASK64 = 0xFFFF_FFFF_FFFF_FFFF


def token_seed(seed: int, index: int) -> int:
    """A 64-bit seed for output token `index` of a request seeded with `seed` (splitmix64 of the pair: nearby
    seeds and indices give unrelated streams)."""
    z = (seed * 0x9E37_79B9_7F4A_7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & _MASK64
    return z ^ (z >> 31)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask to −inf everything outside the top-k and the top-p nucleus of one row of (scaled) logits."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep a token if the mass strictly before it is below top_p (the first token is always kept).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[..., 0] = False  # a top_p below float32's range would otherwise drop every token (NaN probs)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One row of float32 logits [V] → its token id as a one-element tensor on the logits' device (no host sync)."""
    if is_greedy(params):
        return torch.argmax(logits).reshape(1)
    scaled = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One row of float32 logits [V] → token id."""
    return int(sample_row(logits, params, generator))


def _row_logprobs(logits: torch.Tensor, token: torch.Tensor, num_top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """On the device: [logprob of `token`, top `num_top` logprobs] and the top ids, under the model's distribution
    (before temperature and filtering)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(0, token)
    if num_top <= 0:
        return chosen, token.new_empty(0)
    values, ids = torch.topk(logp, num_top)
    return torch.cat((chosen, values)), ids


def token_logprob(logits: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    """Log-probability under the model's distribution (before temperature and filtering), plus the top ones."""
    values, ids = _row_logprobs(logits, torch.tensor([token_id], device=logits.device), num_top)
    return _to_token_logprob(token_id, values.tolist(), ids.tolist())


def _to_token_logprob(token_id: int, values: list[float], ids: list[int]) -> TokenLogprob:
    return TokenLogprob(token_id=token_id, logprob=float(values[0]),
                        top_logprobs=[(int(i), float(v)) for i, v in zip(ids, values[1:], strict=True)])


@dataclass
class SampledTokens:
    """One batch's sampled tokens (and logprobs), still on the device.

    `tokens` [S] int64 feeds the next step's input ids without a host sync (overlap scheduling). The host reads
    everything once: `start_copy` queues non-blocking copies into pinned memory and records an event, `read`
    waits for that event (the step's one host sync); without `start_copy`, `read` copies synchronously."""

    tokens: torch.Tensor
    logprob_values: torch.Tensor | None = None  # per row asking for logprobs: [chosen, top...], concatenated
    logprob_ids: torch.Tensor | None = None  # per row asking for logprobs: its top ids, concatenated
    num_top: list[int | None] = field(default_factory=list)  # per row: top logprobs asked for (None: no logprobs)
    _host: tuple[torch.Tensor, ...] | None = None
    _ready: torch.cuda.Event | None = None

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        extra = () if self.logprob_values is None else (self.logprob_values, self.logprob_ids)
        return (self.tokens, *extra)

    def start_copy(self) -> None:
        """Queue the device → host copies behind the sampling kernels (CUDA; on CPU the tensors are host memory)."""
        if self.tokens.device.type != "cuda":
            return
        host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in self._tensors())
        for dst, src in zip(host, self._tensors(), strict=True):
            dst.copy_(src, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record(torch.cuda.current_stream(self.tokens.device))
        self._host = host

    def is_ready(self) -> bool:
        """Whether reading now would not wait (tests of the overlap: the host runs ahead of the GPU)."""
        return self._ready is None or self._ready.query()

    def read(self) -> tuple[list[int], list[TokenLogprob | None]]:
        if self._host is not None:
            assert self._ready is not None
            self._ready.synchronize()
            host = self._host
        else:
            host = self._tensors()
        tokens = host[0].tolist()
        logprobs: list[TokenLogprob | None] = []
        if len(host) == 1:
            return tokens, [None] * len(tokens)
        values, ids = host[1].tolist(), host[2].tolist()
        v = i = 0
        for tok, k in zip(tokens, self.num_top, strict=True):
            if k is None:
                logprobs.append(None)
                continue
            logprobs.append(_to_token_logprob(tok, values[v : v + 1 + k], ids[i : i + k]))
            v, i = v + 1 + k, i + k
        return tokens, logprobs


class Sampler:
    """Samples one token per row of a logits batch, with each row's own params and generator."""

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Sample and read the tokens now (one host sync)."""
        return self.sample_on_device(logits, params, generators).read()

    def sample_on_device(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        model_logits: torch.Tensor | None = None,
    ) -> SampledTokens:
        """Sample without waiting for the device: the tokens (and logprobs) stay device tensors. `logits` are what
        to sample from (after engine/logits_processor.py); the logprobs are taken from `model_logits`, the
        model's own distribution, when given (vLLM's default: raw logprobs)."""
        logits = logits.float()
        model_logits = logits if model_logits is None else model_logits.float()
        greedy = [i for i, p in enumerate(params) if is_greedy(p)]
        if len(greedy) == len(params):
            tokens = torch.argmax(logits, dim=-1)
        else:
            tokens = torch.empty(len(params), dtype=torch.int64, device=logits.device)
            if greedy:
                rows = torch.tensor(greedy, dtype=torch.int64).to(logits.device, non_blocking=True)
                tokens.index_copy_(0, rows, torch.argmax(logits[rows], dim=-1))
            for i, p in enumerate(params):
                if not is_greedy(p):
                    tokens[i : i + 1] = sample_row(logits[i], p, generators[i])
        out = SampledTokens(tokens=tokens, num_top=[p.logprobs for p in params])
        values, ids = [], []
        for i, p in enumerate(params):
            if p.logprobs is not None:
                v, t = _row_logprobs(model_logits[i], tokens[i : i + 1], p.logprobs)
                values.append(v)
                ids.append(t)
        if values:
            out.logprob_values, out.logprob_ids = torch.cat(values), torch.cat(ids)
        return out
