"""The decode benchmark runs end to end on CPU at tiny sizes (slow: excluded from make test)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
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


@pytest.mark.slow
def test_bench_decode_smoke_tp2(tmp_path):
    """`--tp-size 2` on CPU: two rank processes over gloo, one shared host pool; rank 0 reports."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "r.json"
    # A subprocess: the rank processes are spawned and must import the script as a module.
    proc = subprocess.run([sys.executable, "benchmarks/bench_decode.py", "--smoke", "--tp-size", "2", "--miss-rates",
                           "--batch-sizes", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "one copy for 2 rank(s)" in proc.stdout
    results = json.loads(out.read_text())["results"]
    assert all("error" not in r and r["tp_size"] == 2 for r in results), results
    sparse = [r for r in results if r["mode"] == "hisparse"]
    assert sparse and all(r["host_pool_bytes"] > 0 and r["host_pool_shmem_bytes"] is not None for r in sparse)


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
    # Every timed step replayed a CUDA graph (captured after the synthetic top-k was installed).
    assert all(r["cuda_graph"] and r["graph_replays"] >= 3 and r["graph_capture_s"] > 0 for r in results), results


def test_bench_decode_fill_is_checked(tmp_path, monkeypatch):
    """The synthetic KV fill reads back the first request's host rows: a copy that wrote nothing is reported as
    that run's error instead of timing a pool of zeros; the dense run beside it is unaffected."""
    spec = importlib.util.spec_from_file_location("bench_decode_fill", ROOT / "benchmarks" / "bench_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "copy_rows", lambda *args: None)
    out = tmp_path / "r.json"
    bench.main(["--smoke", "--contexts", "192", "--miss-rates", "--batch-sizes", "--steps", "2", "--out", str(out),
                "--plot", str(tmp_path / "r.png")])  # fmt: skip
    results = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert "does not hold the injected rows" in results["hisparse"]["error"]
    assert "error" not in results["dense"] and results["dense"]["fill_s"] >= 0


def test_dense_synthetic_topk_baseline(tmp_path, monkeypatch):
    """--dense-synthetic-topk adds dense runs over the same synthetic selection as hisparse-mX (named dense-mX),
    so a small-batch comparison charges both modes the selection's own kernels; the window really replaces
    dense's top-k (its selection calls are counted)."""
    spec = importlib.util.spec_from_file_location("bench_decode_dense_syn", ROOT / "benchmarks" / "bench_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    calls: dict[str, int] = {}

    class Counting(bench.SyntheticTopK):
        def index_topk(self, layer_id, q, weights, top_k):
            mode = "hisparse" if self.engine.config.enable_hisparse else "dense"
            calls[mode] = calls.get(mode, 0) + 1
            return super().index_topk(layer_id, q, weights, top_k)

    monkeypatch.setattr(bench, "SyntheticTopK", Counting)
    out = tmp_path / "r.json"
    assert bench.main(["--smoke", "--contexts", "192", "--miss-rates", "0.2", "--skip-model-indexer-run",
                       "--batch-sizes", "--max-batch", "1", "--dense-synthetic-topk", "--steps", "2",
                       "--out", str(out), "--plot", str(tmp_path / "r.png")]) == 0
    runs = json.loads(out.read_text())["results"]
    by_run = {(r["mode"], r["fixed_batch"]): r for r in runs}
    assert {"dense-m20", "hisparse-m20"} <= {mode for mode, _ in by_run}, sorted(by_run)
    assert all("error" not in r for r in runs), runs
    # Dense over the window holds as many requests as plain dense (same memory; only the selection differs).
    assert by_run[("dense-m20", None)]["batch"] == by_run[("dense", None)]["batch"]
    assert calls.get("dense", 0) > 0 and calls.get("hisparse", 0) > 0, calls
    assert bench.run_name("dense", 0.05) == "dense-m5"


@pytest.mark.slow
def test_bench_decode_prefetch_switch(tmp_path):
    """`--hisparse-prefetch-shared-layers both` on tiny-glm5 (full, shared, full, shared): each HiSparse run twice,
    the `+pf` one with the prefetch on (two followers started early per decode step), the same hit rate; with
    `--hisparse-early-swap-in on` every run is a `+early` one."""
    spec = importlib.util.spec_from_file_location("bench_decode_pf", ROOT / "benchmarks" / "bench_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    assert bench.main(["--smoke", "--config", "tiny-glm5", "--contexts", "192", "--modes", "hisparse",
                       "--miss-rates", "0.2", "--skip-model-indexer-run", "--hisparse-prefetch-shared-layers", "both",
                       "--hisparse-early-swap-in", "on", "--out", str(out), "--plot", str(tmp_path / "r.png")]) == 0
    results = {(r["mode"], r["fixed_batch"]): r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {("hisparse-m20+early", None), ("hisparse-m20+pf+early", None), ("hisparse+early", 1),
                            ("hisparse+pf+early", 1)}
    for (mode, batch), r in results.items():
        assert "error" not in r, r
        on = "+pf" in mode
        assert r["prefetch_shared_layers"] is on and r["early_swap_in"] is True
        assert (r["prefetch_launched"] > 0) is on
        other = results[(mode.replace("+pf", "") if on else mode.replace("+early", "+pf+early"), batch)]
        assert r["hit_rate"] == other["hit_rate"] and r["batch"] == other["batch"]


@pytest.mark.parametrize(("prefetch", "early", "shared", "expected"), [
    ("on", "off", False, ["hisparse"]),
    ("on", "both", False, ["hisparse", "hisparse+early"]),
    ("both", "off", True, ["hisparse", "hisparse+pf"]),
    ("both", "both", True, ["hisparse", "hisparse+early", "hisparse+pf", "hisparse+pf+early"]),
    ("off", "on", True, ["hisparse+early"]),
])
def test_hisparse_variants_and_their_names(prefetch, early, shared, expected):
    """Each planned HiSparse run expands to the switches' variants (the prefetch only where the model has shared
    layers); a synthetic miss rate's name keeps the suffixes; dense is never expanded."""
    spec = importlib.util.spec_from_file_location("bench_decode_variants", ROOT / "benchmarks" / "bench_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = argparse.Namespace(hisparse_prefetch_shared_layers=prefetch, hisparse_early_swap_in=early)
    assert bench.hisparse_variants(args, "hisparse", shared) == expected
    assert bench.hisparse_variants(args, "dense", shared) == ["dense"]
    assert [bench.run_name(v, 0.05) for v in expected] == [v.replace("hisparse", "hisparse-m5") for v in expected]
    assert bench.run_name("dense", None) == "dense"


def test_side_copy_block_variants_expand_only_side_stream_runs():
    """--hisparse-side-copy-blocks N ... runs each variant with side-stream swap-ins once per cap (+cbN), and the
    cap a mode name carries is the one its engine gets; variants without a side stream stay single."""
    spec = importlib.util.spec_from_file_location("bench_decode_caps", ROOT / "benchmarks" / "bench_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = argparse.Namespace(hisparse_prefetch_shared_layers="on", hisparse_early_swap_in="both",
                              hisparse_side_copy_blocks=[0, 24])
    assert bench.hisparse_variants(args, "hisparse", False) == ["hisparse", "hisparse+early+cb0", "hisparse+early+cb24"]
    assert bench.side_copy_blocks("hisparse-m5+early+cb24") == 24
    assert bench.side_copy_blocks("hisparse+early") == bench.HiSparseConfig().side_stream_copy_blocks
    assert bench.run_name("hisparse+early+cb24", 0.05) == "hisparse-m5+early+cb24"
