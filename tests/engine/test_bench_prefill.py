"""The prefill benchmark runs end to end on CPU at tiny sizes (a few seconds): every mode, the ratio to dense,
HiSparse on its staging area and the gather mode on the reference path; with FP8 weights too."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_prefill_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_prefill", ROOT / "benchmarks" / "bench_prefill.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    by_mode = {(r["mode"], r["prompt_len"]): r for r in results}
    for length in (96, 200):
        dense, staged, gathered = (by_mode[(m, length)] for m in ("dense", "hisparse", "hisparse-gather"))
        assert dense["time_vs_dense"] == 1.0 and dense["h2d_bytes"] == 0
        assert staged["ms"] > 0 and staged["tokens_per_s"] > 0 and staged["time_vs_dense"] > 0
        assert staged["staged_forwards"] > 0 and staged["gathered_forwards"] == 0 and staged["staging_rows"] > 0
        assert gathered["gathered_forwards"] > 0 and gathered["staging_rows"] == 0
        assert staged["d2h_bytes"] > 0 and staged["h2d_bytes"] > 0
    table = capsys.readouterr().out.strip().splitlines()
    assert table[-1].startswith("hisparse-gather") and "vs dense" in table[-7]


def test_bench_prefill_smoke_with_fp8_weights(tmp_path, capsys, monkeypatch):
    """`--quantization fp8` builds block-FP8 projections (the CPU runs their reference GEMMs) and the JSON and the
    table say which FP8 GEMM backends were allowed, so an A/B run against $HISPARSE_FP8_GEMM=triton is labelled."""
    spec = importlib.util.spec_from_file_location("bench_prefill", ROOT / "benchmarks" / "bench_prefill.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setenv("HISPARSE_FP8_GEMM", "triton")
    out = tmp_path / "r.json"
    assert bench.main(["--smoke", "--quantization", "fp8", "--modes", "dense", "hisparse", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["fp8_gemm_backend"] == "triton" and data["meta"]["args"]["quantization"] == "fp8"
    assert {r["mode"] for r in data["results"]} == {"dense", "hisparse"}
    assert all(r["ms"] > 0 for r in data["results"])
    assert "weights fp8 (FP8 GEMMs: triton)" in capsys.readouterr().out


def test_bench_prefill_smoke_with_cached_prefixes(tmp_path, capsys):
    """`--cached-prefix-fractions`: each mode again with prefix caching, every timed prompt sharing its first half
    with one prefilled before it; the rows say how many tokens were reused (whole pages of 16 here)."""
    spec = importlib.util.spec_from_file_location("bench_prefill", ROOT / "benchmarks" / "bench_prefill.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    assert bench.main(["--smoke", "--modes", "dense", "hisparse", "--cached-prefix-fractions", "0.5",
                       "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    cached = {(r["mode"], r["prompt_len"]): r for r in results if "cached_prefix" in r}
    assert set(cached) == {(m, n) for m in ("dense", "hisparse") for n in (96, 200)}
    for (_, length), r in cached.items():
        assert r["cached_prefix"] == 0.5 and r["cached_tokens"] == (length // 2) // 16 * 16 > 0
        assert r["ms"] > 0 and r["time_vs_dense"] > 0
    assert "cached" in capsys.readouterr().out
