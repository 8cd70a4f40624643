"""What penalties, logit bias and min_tokens add to a decode step's sampling (engine/logits_processor.py).

Per step and batch size: the plain greedy pick (`Sampler.sample_on_device`, an argmax over the vocabulary) against
the same with every row penalized (repetition, frequency and presence penalties, a logit bias of `--bias-entries`
ids, min_tokens holding back EOS) — apply, pick, advance the counts — at the vocabulary of DeepSeek-V3.2 (129280).
Timed as the engine runs it: host and device together, `--steps` steps back to back, one sync at the end (µs a
step), after warm-up steps; the counts are built before timing (once per request in the engine).

    python benchmarks/bench_logits_processing.py --batch-sizes 1 16 64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import warnings

import torch

from decode_server.engine.logits_processor import LogitsProcessor
from decode_server.engine.request import Request
from decode_server.engine.sampler import Sampler
from decode_server.engine.sampling_params import SamplingParams

logger = logging.getLogger("bench_logits_processing")


def make_requests(batch: int, vocab: int, prompt_len: int, bias_entries: int, penalized: bool) -> list[Request]:
    gen = torch.Generator().manual_seed(batch)
    reqs = []
    for i in range(batch):
        edits = {} if not penalized else {
            "repetition_penalty": 1.1, "frequency_penalty": 0.4, "presence_penalty": 0.2, "min_tokens": 10**6,
            "logit_bias": {int(t): 1.5 for t in torch.randperm(vocab, generator=gen)[:bias_entries]},
        }  # fmt: skip
        params = SamplingParams(max_tokens=10**6, temperature=0.0, **edits)
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        reqs.append(Request(rid=f"r{i}", prompt_ids=prompt, params=params, arrival=i, eos_token_ids=frozenset({1})))
    return reqs


def time_steps(logits: torch.Tensor, reqs: list[Request], steps: int, warmup: int) -> tuple[float, int]:
    """µs per step of apply → greedy pick → record, host and device together; and how many synchronizing torch
    operations one step makes (torch's sync debug mode: it must be 0, the engine reads its tokens later)."""
    proc, sampler = LogitsProcessor(logits.device), Sampler()
    params, generators = [r.params for r in reqs], [None] * len(reqs)

    def step() -> None:
        processed = proc.apply(logits, reqs)
        tokens = sampler.sample_on_device(processed, params, generators, model_logits=logits).tokens
        proc.record(tokens)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchronizing" in str(w.message) for w in caught)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e6, syncs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--prompt-len", type=int, default=32768)
    ap.add_argument("--bias-entries", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    rows = []
    for batch in args.batch_sizes:
        logits = torch.randn(batch, args.vocab, device="cuda")
        plain, _ = time_steps(logits, make_requests(batch, args.vocab, 1, 0, False), args.steps, args.warmup)
        edited, syncs = time_steps(logits, make_requests(batch, args.vocab, args.prompt_len, args.bias_entries,
                                                         True), args.steps, args.warmup)
        rows.append({"batch": batch, "vocab": args.vocab, "plain_us": round(plain, 1),
                     "penalized_us": round(edited, 1), "added_us": round(edited - plain, 1),
                     "penalized_syncs_per_step": syncs})
    logger.info("%6s %10s %14s %10s %6s", "batch", "plain µs", "penalized µs", "added µs", "syncs")
    for r in rows:
        logger.info("%6d %10.1f %14.1f %10.1f %6d", r["batch"], r["plain_us"], r["penalized_us"], r["added_us"],
                    r["penalized_syncs_per_step"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
