"""benchmarks/bench_logits_processing.py's structured-output part runs on the CPU (its timings are the GPU's job)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("xgrammar")
ROOT = Path(__file__).resolve().parents[2]


def test_grammar_timing_over_a_synthetic_vocabulary():
    spec = importlib.util.spec_from_file_location("bench_lp", ROOT / "benchmarks" / "bench_logits_processing.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tokenizer = bench.SyntheticTokenizer(4096)
    vocab = tokenizer.encoded_vocab()
    assert len(vocab) == len(set(vocab)) == 4096 and vocab[32] == "Ġ"  # byte 0x20 spelled as GPT-2 does
    out = bench.time_grammar(2, 4096, 2, device="cpu")
    assert 0 < out["object_start_allowed"] < 50  # "{" and the spellings that start with it
    assert out["in_string_allowed"] > 3000  # inside a free string most tokens may follow
    assert out["compile_ms"] > 0 and out["in_string_fill_us"] > 0
