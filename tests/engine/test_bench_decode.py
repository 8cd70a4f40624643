"""The decode benchmark runs end to end on CPU at tiny sizes (slow: excluded from make test)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_decode_smoke(tmp_path):
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "benchmarks" / "bench_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert bench.main(["--smoke", "--out", str(out), "--plot", str(png), "--miss-rates", "0.15"]) == 0
    results = json.loads(out.read_text())["results"]
    by_mode = {(r["mode"], r["context"], r["fixed_batch"]): r for r in results}
    for ctx in (192, 384):
        dense, sparse = by_mode[("dense", ctx, None)], by_mode[("hisparse", ctx, None)]
        assert sparse["batch"] > dense["batch"], "HiSparse must fit more requests in the same device budget"
        assert 0.0 < sparse["hit_rate"] < 1.0 and sparse["pcie_bytes_per_step"] > 0
        assert ("hisparse-m15", ctx, None) in by_mode
    assert png.stat().st_size > 0


@pytest.mark.gpu
def test_bench_decode_gpu_preflight(tmp_path):
    """A short run of the real benchmark config on CUDA, so a full run does not fail late. At 16K context and a
    1 GiB budget dense holds 12 requests, HiSparse hits the batch cap of 16."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "benchmarks" / "bench_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    argv = ["--contexts", "16384", "--steps", "3", "--warmup", "1", "--device-kv-budget-gib", "1",
            "--host-kv-budget-gib", "4", "--max-batch", "16", "--miss-rates", "0.15", "--out", str(out)]
    assert bench.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert all("error" not in r for r in results), results
    by_mode = {(r["mode"], r["fixed_batch"]): r for r in results}
    assert by_mode[("hisparse", None)]["batch"] > by_mode[("dense", None)]["batch"]
    assert by_mode[("hisparse-m15", None)]["hit_rate"] < 1.0
