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
