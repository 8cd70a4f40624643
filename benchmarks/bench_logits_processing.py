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


def _byte_level_char(b: int) -> str:
    """GPT-2's byte → printable character map (byte-level BPE vocabularies spell bytes this way)."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    return chr(b) if b in printable else chr(256 + sorted(set(range(256)) - set(printable)).index(b))


class SyntheticTokenizer:
    """A byte-level vocabulary of `vocab` tokens: the 256 bytes, then random runs of 2–8 printable ASCII characters
    (a leading space half the time), as a stand-in for a real 129K vocabulary (none is available offline)."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        import random

        rng = random.Random(seed)
        alphabet = [chr(c) for c in range(32, 127)]
        tokens = [_byte_level_char(b) for b in range(256)]
        seen = set(tokens)
        while len(tokens) < vocab:
            word = ("Ġ" if rng.random() < 0.5 else "") + "".join(
                _byte_level_char(ord(c)) for c in rng.choices(alphabet, k=rng.randint(2, 8)))
            if word not in seen:
                seen.add(word)
                tokens.append(word)
        self._tokens = tokens

    def encoded_vocab(self) -> list[str]:
        return self._tokens

    def backend_json(self) -> dict:
        return {"decoder": {"type": "ByteLevel"}}


def time_grammar(batch: int, vocab: int, steps: int, device: str = "cuda") -> dict:
    """Structured outputs at one step: the host's bitmask fill for `batch` JSON-schema matchers (at an object's
    start, and inside a free string: most tokens allowed) and the device's expansion and masking of [batch, vocab]."""
    from decode_server.engine.sampling_params import StructuredOutput
    from decode_server.engine.structured_output import GrammarBackend, allowed_tokens

    tokenizer = SyntheticTokenizer(vocab)
    start = time.perf_counter()
    backend = GrammarBackend(tokenizer, vocab, frozenset({1}), any_whitespace=True)
    ready_s = time.perf_counter() - start
    schema = StructuredOutput(kind="json_schema", spec=json.dumps({
        "type": "object", "required": ["name", "tags"], "properties": {
            "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}}))
    start = time.perf_counter()
    compiled = backend.compile(schema)
    compile_ms = (time.perf_counter() - start) * 1e3
    opening = [tokenizer.encoded_vocab().index(c) for c in ('{', '"', "n", "a", "m", "e", '"', ":", '"')]
    out = {"batch": batch, "vocab": vocab, "tokenizer_ready_s": round(ready_s, 2), "compile_ms": round(compile_ms, 1)}
    logits = torch.randn(batch, vocab, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for state, prefix in (("object_start", []), ("in_string", opening)):
        matchers = [backend.matcher(compiled, prefix) for _ in range(batch)]
        backend.bitmask(matchers)
        start = time.perf_counter()
        for _ in range(steps):
            mask = backend.bitmask(matchers)
        fill = (time.perf_counter() - start) / steps * 1e6
        logits.masked_fill_(~allowed_tokens(mask.to(device, non_blocking=True), vocab), float("-inf"))  # warm-up
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            logits.masked_fill_(~allowed_tokens(mask.to(device, non_blocking=True), vocab), float("-inf"))
        sync()
        apply = (time.perf_counter() - start) / steps * 1e6
        out[f"{state}_fill_us"] = round(fill, 1)
        out[f"{state}_apply_us"] = round(apply, 1)
        out[f"{state}_allowed"] = int(allowed_tokens(mask, vocab)[0].sum())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--prompt-len", type=int, default=32768)
    ap.add_argument("--bias-entries", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--grammar", action="store_true",
                    help="also time structured outputs' per-step work over a synthetic byte-level vocabulary")
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
    grammar = []
    if args.grammar:
        grammar = [time_grammar(batch, args.vocab, args.steps // 4) for batch in args.batch_sizes]
        logger.info("structured outputs (synthetic vocabulary of %d; tokenizer info %.2f s, a schema's compile "
                    "%.1f ms):", args.vocab, grammar[0]["tokenizer_ready_s"], grammar[0]["compile_ms"])
        logger.info("%6s %22s %22s", "batch", "object start fill/apply", "in a string fill/apply")
        for g in grammar:
            logger.info("%6d %13.1f / %6.1f µs %13.1f / %6.1f µs", g["batch"], g["object_start_fill_us"],
                        g["object_start_apply_us"], g["in_string_fill_us"], g["in_string_apply_us"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "grammar": grammar}, f, indent=1)


if __name__ == "__main__":
    main()
