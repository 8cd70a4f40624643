"""The decode benchmark runs end to end on CPU at tiny sizes (slow: excluded from make test)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from decode_server.engine.types import HiSparseLayerStats

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


def test_bench_decode_smoke_dp_attention(tmp_path):
    """`--tp-size 2 --dp-size 2 --enable-dp-attention` on CPU: each rank its own batch and host pool, every pass
    agreed on by both ranks; tok/s counts both ranks' tokens."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "r.json"
    argv = ["--smoke", "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--ep-size", "2",
            "--miss-rates", "0.1", "--batch-sizes", "--out", str(out)]
    proc = subprocess.run([sys.executable, "benchmarks/bench_decode.py", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DP attention over 2 ranks" in proc.stdout and "one per rank (2)" in proc.stdout
    results = json.loads(out.read_text())["results"]
    assert results and all("error" not in r and r["dp_size"] == 2 for r in results), results
    for r in results:  # both ranks' tokens: 2 × batch × steps in the timed time
        assert r["tokens_per_s"] == pytest.approx(2 * r["batch"] * 1000 / r["step_ms"], rel=1e-6)
    sparse = [r for r in results if r["mode"].startswith("hisparse")]
    assert sparse and all(r["host_pool_bytes"] > 0 and r["host_pool_shmem_bytes"] is None for r in sparse)


@pytest.mark.parametrize("argv", [["--tp-size", "2", "--dp-size", "2"], ["--tp-size", "2", "--dp-size", "1",
                                                                          "--enable-dp-attention"],
                                  ["--tp-size", "2", "--ep-size", "3"]])
def test_bench_decode_parallel_flags_are_checked(argv):
    spec = importlib.util.spec_from_file_location("bench_decode_flags", ROOT / "benchmarks" / "bench_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--smoke", *argv])
    assert exc.value.code == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_decode_gpu_preflight(tmp_path):
    """A short run of the real benchmark config on CUDA, so a full run does not fail late. At 16K context and a
    1 GiB budget dense holds 12 requests, HiSparse hits the batch cap of 16."""
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
    assert bench.side_copy_blocks("hisparse-m20+pf+cbauto") == "auto"
    assert bench.side_copy_blocks("hisparse-m20+pf+cb0") == 0
    args = bench.parse_args(["--hisparse-side-copy-blocks", "8", "auto", "0"])
    assert args.hisparse_side_copy_blocks == [8, "auto", 0]
    for bad in ("-1", "many"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--hisparse-side-copy-blocks", bad])


def _load_bench(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "bench_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_speculative_and_overlap_variants_and_their_names():
    """--hisparse-speculative-prefetch both runs each HiSparse variant with and without the bets (+spec, a
    side-stream variant, so it takes the copy caps); --cross-layer-overlap values expand synthetic runs only
    (@ovP), and a mode name gives back its cap and its overlap."""
    bench = _load_bench("bench_decode_spec")
    args = argparse.Namespace(hisparse_prefetch_shared_layers="on", hisparse_early_swap_in="off",
                              hisparse_speculative_prefetch="both", hisparse_side_copy_blocks=[24],
                              cross_layer_overlap=[0.0, 0.7])
    assert bench.hisparse_variants(args, "hisparse", False) == ["hisparse", "hisparse+spec+cb24"]
    assert bench.overlap_variants(args, 0.2) == ["@ov0", "@ov70"]
    assert bench.overlap_variants(args, None) == bench.overlap_variants(args, 0.0) == [""]
    assert bench.overlap_variants(argparse.Namespace(cross_layer_overlap=[0.0]), 0.2) == [""]
    name = bench.run_name("hisparse+spec+cb24@ov70", 0.2)
    assert name == "hisparse-m20+spec+cb24@ov70"
    assert bench.side_copy_blocks(name) == 24 and bench.cross_layer_overlap(name) == 0.7
    assert bench.cross_layer_overlap("hisparse-m20+spec") == 0.0


class _Batch:
    is_decode = True

    def __init__(self, rows: int) -> None:
        self.req_rows = torch.arange(rows)

    def mask_padded_topk(self, topk):
        return topk


def _synthetic(bench, overlap: float, miss_rate: float = 0.25, context: int = 1024,
               row_contexts: dict[int, int] | None = None):
    """A SyntheticTopK on tiny-dsa's config (K 64, 3 layers) over a stand-in engine: only what it reads."""
    from types import SimpleNamespace

    from decode_server.model import load_config

    config = load_config("tiny-dsa")
    batch = _Batch(3)
    backend = SimpleNamespace(scratch_row=3, index_topk=lambda *args: None, _current=lambda: batch)
    engine = SimpleNamespace(model_config=config, config=SimpleNamespace(max_running_requests=3),
                             kv=SimpleNamespace(backend=backend), device=torch.device("cpu"))
    return (bench.SyntheticTopK(engine, context, miss_rate, seed=1, cross_layer_overlap=overlap,
                                row_contexts=row_contexts), int(config.index_topk))


@pytest.mark.parametrize("overlap", [0.0, 0.5, 0.75, 1.0])
def test_synthetic_cross_layer_overlap(overlap):
    """The synthetic selections of a step: distinct positions of the context; round(C·K) common to every layer
    (at 0: only chance coincidences of independent windows); each layer's entries new since the last step number
    the miss rate's share of K, and round(C·K)'s share of them enter every layer at once."""
    bench = _load_bench("bench_decode_overlap")
    synthetic, top_k = _synthetic(bench, overlap)
    common = round(overlap * top_k)
    previous = None
    for _ in range(6):
        step = [synthetic.index_topk(layer, torch.zeros(1), torch.zeros(1), top_k) for layer in range(3)]
        for sel in step:
            assert sel.shape == (3, top_k) and sel.min() >= 0 and sel.max() < 1024
            assert all(len(set(row.tolist())) == top_k for row in sel)
        for r in range(3):
            shared = set(step[0][r].tolist()) & set(step[1][r].tolist()) & set(step[2][r].tolist())
            if overlap == 0.0:
                assert len(shared) < top_k // 4  # independent windows of one permutation rarely meet
            else:
                assert len(shared) >= common
            if previous is not None:
                new = [set(step[layer][r].tolist()) - set(previous[layer][r].tolist()) for layer in range(3)]
                assert all(len(n) == synthetic.advance for n in new)
                if overlap > 0:
                    assert len(new[0] & new[1] & new[2]) >= synthetic.common_advance > 0
        previous = step


def test_synthetic_overlap_refuses_a_short_context():
    bench = _load_bench("bench_decode_overlap_short")
    with pytest.raises(ValueError, match="too short"):
        _synthetic(bench, 0.5, context=80)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        _synthetic(bench, 1.5)


def test_synthetic_windows_over_each_requests_own_context():
    """--mixed-contexts with a miss rate: each request's selection is K distinct positions of its own context,
    and K · miss rate of them are new every step (the window wraps around the request's own permutation);
    a request too short for the window, or a cross-layer overlap with lengths of their own, is refused."""
    bench = _load_bench("bench_decode_mixed_synthetic")
    lengths = {0: 90, 1: 1024, 2: 300}
    synthetic, top_k = _synthetic(bench, 0.0, row_contexts=lengths)
    previous = None
    for _ in range(8):  # past a full turn of the 90-position request's window
        step = [synthetic.index_topk(layer, torch.zeros(1), torch.zeros(1), top_k) for layer in range(3)]
        for sel in step:
            assert sel.shape == (3, top_k)
            for r, length in lengths.items():
                row = sel[r].tolist()
                assert len(set(row)) == top_k and min(row) >= 0 and max(row) < length, (r, row)
        if previous is not None:
            for layer in range(3):
                for r in lengths:
                    assert len(set(step[layer][r].tolist()) - set(previous[layer][r].tolist())) == synthetic.advance
        previous = step
    assert set(step[0][0].tolist()) | set(previous[0][0].tolist()) <= set(range(90))
    with pytest.raises(ValueError, match="too short"):
        _synthetic(bench, 0.0, row_contexts={0: 70, 1: 1024})
    with pytest.raises(ValueError, match="cross-layer overlap"):
        _synthetic(bench, 0.5, row_contexts={0: 512})
    with pytest.raises(ValueError, match="row contexts"):
        _synthetic(bench, 0.0, row_contexts={0: 2048})


def test_mixed_contexts_with_a_synthetic_miss_rate(tmp_path):
    """The smoke run of --mixed-contexts with 20 % synthetic misses: HiSparse runs over requests of their own
    lengths, and its hit rate is below 1 (the long requests miss) and above the equal-length run's (the requests
    whose whole context fits their buffer never miss)."""
    bench = _load_bench("bench_decode_mixed_misses")
    hit_rates = {}
    for mixed in (True, False):
        out = tmp_path / f"r{mixed}.json"
        assert bench.main(["--smoke", "--contexts", "1024", "--modes", "hisparse", "--miss-rates", "0.2",
                           "--skip-model-indexer-run", "--steps", "3", "--out", str(out),
                           "--plot", str(tmp_path / "r.png"), *(["--mixed-contexts"] if mixed else [])]) == 0
        runs = {r["mode"]: r for r in json.loads(out.read_text())["results"] if r["fixed_batch"] is None}
        assert set(runs) == {"hisparse-m20"}, sorted(runs)
        run = runs["hisparse-m20"]
        assert "error" not in run and run["mixed_contexts"] is mixed, run
        assert (run["mean_context"] < 1024) is mixed
        hit_rates[mixed] = run["hit_rate"]
    assert hit_rates[False] < hit_rates[True] < 1.0, hit_rates


@pytest.mark.slow
def test_bench_decode_speculative_prefetch_switch(tmp_path):
    """tiny-dsa, 20 % synthetic misses, cross-layer overlap 0 and 0.75, bets off and on: the bets copy rows only
    in +spec runs, and at 0.75 they turn most of layers 1-2's misses into hits (the own hit rate rises), which
    they cannot do at 0."""
    bench = _load_bench("bench_decode_spec_smoke")
    out = tmp_path / "r.json"
    assert bench.main(["--smoke", "--contexts", "512", "--modes", "hisparse", "--miss-rates", "0.2",
                       "--skip-model-indexer-run", "--batch-sizes", "--hisparse-speculative-prefetch", "both",
                       "--cross-layer-overlap", "0", "0.75", "--out", str(out), "--plot", str(tmp_path / "r.png")]) == 0
    results = {r["mode"]: r for r in json.loads(out.read_text())["results"] if r["fixed_batch"] is None}
    assert set(results) == {"hisparse-m20@ov0", "hisparse-m20@ov75", "hisparse-m20+spec@ov0",
                            "hisparse-m20+spec@ov75"}, sorted(results)
    for mode, r in results.items():
        assert "error" not in r, r
        assert r["speculative_prefetch"] is ("+spec" in mode)
        assert (r["speculative_rows_per_step"] > 0) is ("+spec" in mode)
    gain = {ov: results[f"hisparse-m20+spec@ov{ov}"]["hit_rate"] - results[f"hisparse-m20@ov{ov}"]["hit_rate"]
            for ov in (0, 75)}
    assert gain[75] > 0.05 and gain[75] > gain[0] + 0.05, gain


def test_speculative_rows_price_the_bets_against_the_measured_layers_copies():
    """A bet-on layer without a shared follower (GLM-5's last) copies rows that no counterfactual prices: they count
    in all the bets copied, not in the copies the payoff is read against."""
    bench = _load_bench("bench_decode_spec_rows")
    layers = [HiSparseLayerStats(layer=0, misses=5),
              HiSparseLayerStats(layer=1, speculative_misses=10, speculative_rows_saved=7),
              HiSparseLayerStats(layer=2, speculative_misses=4)]  # bet on, no follower
    engine = SimpleNamespace(stats=lambda: SimpleNamespace(hisparse_layers=layers))
    assert bench.speculative_rows(engine) == (14, 10, 7)
    layers[1] = HiSparseLayerStats(layer=1, speculative_misses=10)  # DeepSeek-V3.2: no layer has a follower
    assert bench.speculative_rows(engine) == (14, 0, None)


def test_bench_decode_reports_the_bets_payoff_on_shared_layers(tmp_path):
    """tiny-glm5 (full, shared, full, shared), 20 % synthetic misses, cross-layer overlap 0 and 1: the bets on full
    layer 2 save its own swap-ins rows (its follower's misses − its own) in proportion to what they copied only
    where the layers select alike; runs without bets report no payoff (None)."""
    bench = _load_bench("bench_decode_spec_payoff")
    out = tmp_path / "r.json"
    assert bench.main(["--smoke", "--config", "tiny-glm5", "--contexts", "512", "--modes", "hisparse",
                       "--miss-rates", "0.2", "--skip-model-indexer-run", "--batch-sizes",
                       "--hisparse-speculative-prefetch", "both", "--hisparse-prefetch-shared-layers", "on",
                       "--cross-layer-overlap", "0", "1.0", "--out", str(out), "--plot", str(tmp_path / "r.png")]) == 0
    results = {r["mode"]: r for r in json.loads(out.read_text())["results"] if r["fixed_batch"] is None}
    for mode, r in results.items():
        assert (r["speculative_rows_saved_per_step"] is None) is ("+spec" not in mode), mode
        # tiny-glm5's one bet-on layer (2) has a follower (3): every copied row is a measured one.
        assert r["speculative_rows_measured_per_step"] == (r["speculative_rows_per_step"] if "+spec" in mode
                                                           else None), mode
    correlated, uncorrelated = results["hisparse-m20+pf+spec@ov100"], results["hisparse-m20+pf+spec@ov0"]
    assert correlated["speculative_rows_saved_per_step"] > 0.5 * correlated["speculative_rows_per_step"] > 0
    assert uncorrelated["speculative_rows_saved_per_step"] < 0.25 * uncorrelated["speculative_rows_per_step"]


def test_mixed_contexts_and_indexer_split(tmp_path, monkeypatch):
    """`--mixed-contexts` gives each request its own context in [L/8, L] (its pools hold exactly that many
    positions, the first request's host rows read back); `--indexer-split both` runs each mode with the balanced scores kernel and again with the
    per-query one (`+pq`), the kernel's default config set for the run and restored after it."""
    spec = importlib.util.spec_from_file_location("bench_decode_mixed", ROOT / "benchmarks" / "bench_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.request_contexts(384, 3, False, 0) == [384] * 3
    lengths = bench.request_contexts(384, 200, True, 0)
    assert min(lengths) >= 48 and max(lengths) <= 384 and len(set(lengths)) > 50
    seen: dict[str, tuple[bool, list[int]]] = {}
    timed_run = bench._timed_run

    def recording(args, model, model_config, mode, *rest):
        result = timed_run(args, model, model_config, mode, *rest)
        seen[mode] = (bench.indexer_fast.DEFAULT_CONFIG.balanced, result["mean_context"])
        return result

    monkeypatch.setattr(bench, "_timed_run", recording)
    injected: list[int] = []
    inject = bench.SyntheticKV.inject

    def counting(self, engine, req, context):
        injected.append(context)
        return inject(self, engine, req, context)

    monkeypatch.setattr(bench.SyntheticKV, "inject", counting)
    out = tmp_path / "r.json"
    assert bench.main(["--smoke", "--contexts", "384", "--miss-rates", "--batch-sizes", "--steps", "2",
                       "--mixed-contexts", "--indexer-split", "both", "--out", str(out),
                       "--plot", str(tmp_path / "r.png")]) == 0
    runs = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert set(runs) == {"dense", "dense+pq", "hisparse", "hisparse+pq"}, sorted(runs)
    assert all("error" not in r and r["mixed_contexts"] for r in runs.values()), runs
    assert {mode: balanced for mode, (balanced, _) in seen.items()} == {
        "dense": True, "dense+pq": False, "hisparse": True, "hisparse+pq": False}
    assert bench.indexer_fast.DEFAULT_CONFIG.balanced  # restored
    assert runs["dense+pq"]["indexer_scores"] == "per-query" and runs["dense"]["indexer_scores"] == "balanced"
    # Each mode's requests got the seeded lengths (the same in both kernels' runs), not all 384.
    for mode in ("dense", "hisparse"):
        assert runs[mode]["batch"] == runs[mode + "+pq"]["batch"]
        assert runs[mode]["mean_context"] == runs[mode + "+pq"]["mean_context"] < 384
    assert injected and set(injected) <= set(lengths) and len(set(injected)) > 1
    assert bench.parse_args(["--mixed-contexts", "--miss-rates", "0.05"]).mixed_contexts
    for refused in (["--cross-layer-overlap", "0", "0.5"], ["--sweep-kv-gib-per-layer", "0.5"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--mixed-contexts", "--miss-rates", "0.05", *refused])


def test_penalized_sampling_runs_the_logits_processing(tmp_path, monkeypatch):
    """--sampling penalized: every request of both modes carries counts (a slot of the processor's table each)
    through the timed steps."""
    spec = importlib.util.spec_from_file_location("bench_decode_penalized", ROOT / "benchmarks" / "bench_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    seen: list[int] = []
    real_fill = bench.fill

    def fill(engine, *args, **kwargs):
        contexts = real_fill(engine, *args, **kwargs)
        seen.append(engine.logits_processor.slots_in_use - len(contexts))
        return contexts

    monkeypatch.setattr(bench, "fill", fill)
    out = tmp_path / "r.json"
    bench.main(["--smoke", "--contexts", "192", "--miss-rates", "--batch-sizes", "--steps", "2", "--sampling",
                "penalized", "--out", str(out), "--plot", str(tmp_path / "r.png")])  # fmt: skip
    data = json.loads(out.read_text())
    assert data["meta"]["args"]["sampling"] == "penalized"
    assert seen and set(seen) == {0} and all("error" not in r for r in data["results"])
