"""Token sampling: greedy, temperature, top-k, top-p, each request with its own seeded generator.

Per-request generators make a request's tokens depend only on its own seed and logits, never on which other
requests share the batch, so results are reproducible under continuous batching. The generator is re-seeded
before every token from (request seed, index of the token in the output) — counter-based, as JAX's and
Philox's keyed streams are — so token i does not depend on how many random draws came before it in this
process: a PD decode server, which starts at output token 1 (the prefill server sampled token 0), samples what a
colocated server would, and a retracted-and-resumed request cannot drift.
"""

from __future__ import annotations

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


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One row of float32 logits [V] → token id."""
    if is_greedy(params):
        return int(torch.argmax(logits))
    scaled = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprob(logits: torch.Tensor, token_id: int, num_top: int) -> TokenLogprob:
    """Log-probability under the model's distribution (before temperature and filtering), plus the top ones."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if num_top > 0:
        values, ids = torch.topk(logp, num_top)
        top = [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return TokenLogprob(token_id=token_id, logprob=float(logp[token_id]), top_logprobs=top)


class Sampler:
    """Samples one token per row of a logits batch, with each row's own params and generator."""

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        logits = logits.float()
        tokens: list[int] = []
        logprobs: list[TokenLogprob | None] = []
        greedy = [i for i, p in enumerate(params) if is_greedy(p)]
        # The one host sync of a decode step is reading these ids; the rows are picked on the device first.
        if len(greedy) == len(params):
            greedy_ids = torch.argmax(logits, dim=-1).tolist()
        elif greedy:
            rows = torch.tensor(greedy, dtype=torch.int64).to(logits.device, non_blocking=True)
            greedy_ids = torch.argmax(logits[rows], dim=-1).tolist()
        else:
            greedy_ids = []
        greedy_of = dict(zip(greedy, greedy_ids, strict=True))
        for i, p in enumerate(params):
            tok = greedy_of[i] if i in greedy_of else sample_one(logits[i], p, generators[i])
            tokens.append(int(tok))
            logprobs.append(token_logprob(logits[i], int(tok), p.logprobs) if p.logprobs is not None else None)
        return tokens, logprobs
