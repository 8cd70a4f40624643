"""Prompt logprobs (vLLM's `prompt_logprobs`; behind completions' `echo` + `logprobs` and /generate's
`logprob_start_len`): the log-probability the model gives each prompt token after the tokens before it, and the best
alternatives there, under the model's own distribution (as output logprobs: before temperature and filtering).

A prefill pass computes the hidden state of every prompt position anyway; the logits of the positions whose next
token is a prompt token are computed here in slices of SLICE_ROWS rows (a whole 8K chunk's logits over a 129K
vocabulary would take 4 GiB), read by the host at once (a sync: only passes with such a request pay it). The
prompt's last position predicts the first generated token: its logprob is that token's. The first prompt token has
no logprob (None).
"""

from __future__ import annotations

from typing import Any

import torch

from decode_server.engine.types import TokenLogprob

SLICE_ROWS = 256


def chunk_prompt_logprobs(model: Any, hidden: torch.Tensor, prompt_ids: list[int], start: int, num_top: int
                          ) -> list[TokenLogprob]:  # fmt: skip
    """`hidden` [n, H]: the states of prompt positions start .. start+n-1 of one request (one prefill chunk). Returns
    the logprobs of prompt tokens start+1 .. (the ones those positions predict), in order."""
    last = min(start + hidden.shape[0], len(prompt_ids) - 1)  # positions whose next token is a prompt token
    out: list[TokenLogprob] = []
    for a in range(start, last, SLICE_ROWS):
        b = min(a + SLICE_ROWS, last)
        logp = torch.log_softmax(model.compute_logits(hidden[a - start : b - start]).float(), dim=-1)
        targets = torch.tensor(prompt_ids[a + 1 : b + 1], dtype=torch.int64, device=logp.device)
        chosen = logp.gather(1, targets[:, None])[:, 0].tolist()
        if num_top > 0:
            values, ids = torch.topk(logp, num_top, dim=-1)
            tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
        else:
            tops = [[] for _ in chosen]
        out += [TokenLogprob(token_id=t, logprob=c, top_logprobs=top)
                for t, c, top in zip(prompt_ids[a + 1 : b + 1], chosen, tops, strict=True)]
    return out
