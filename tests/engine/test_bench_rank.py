"""Issue 22 on CPU: the rank configs (one expert-parallel rank's share of DeepSeek-V3.2 and GLM-5), what the
planner says they weigh per GPU, the random FP8 build on the target device, and bench_decode's planned-memory path
with the roofline floor end to end on tiny-dsa."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from decode_server.config import EngineConfig
from decode_server.engine import memory
from decode_server.engine.kv_rows import CacheGeometry
from decode_server.model import load_config
from decode_server.model.construct import build_empty_model, randomize_weights
from decode_server.model.quantization import FP8_DTYPE
from decode_server.planner import GPU_MEMORY, make_plan, read_config_json

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, layers, moe, experts, hidden, vocab, index_layers", [
    ("dsv32-rank-ep8", 61, 58, 32, 7168, 129280, 61),
    ("dsv32-rank-ep16", 61, 58, 16, 7168, 129280, 61),
    ("glm5-rank-ep8", 78, 75, 32, 6144, 154880, 21),
])
def test_rank_configs(name, layers, moe, experts, hidden, vocab, index_layers):
    config = load_config(name)
    assert (config.num_hidden_layers, config.n_routed_experts, config.hidden_size, config.vocab_size) == (
        layers, experts, hidden, vocab)
    assert sum(config.is_moe_layer(i) for i in range(layers)) == moe and config.first_k_dense_replace == 3
    assert config.num_experts_per_tok == 8 and config.n_shared_experts == 1
    assert len(config.index_layer_ids) == index_layers
    assert config.quantization_config["quant_method"] == "fp8" and config.weight_block_size == (128, 128)
    # group-limited routing must leave at least top-k experts to pick from
    per_group = config.n_routed_experts // config.n_group
    assert config.n_routed_experts % config.n_group == 0 and per_group * config.topk_group >= 8


def test_glm5_rank_shares_top_k_one_layer_in_four():
    """GLM-5's IndexShare schedule as transformers reads index_topk_freq 4 (offset 2): layers 0 and 1 full, then
    every 4th; the rest reuse the previous full layer's top-k."""
    config = load_config("glm5-rank-ep8")
    assert config.index_layer_ids == (0, 1, *range(5, 78, 4))
    glm5 = load_config("glm-5")
    same = ("hidden_size", "num_attention_heads", "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "index_n_heads",
            "moe_intermediate_size", "intermediate_size", "n_group", "topk_group")
    assert all(getattr(config, f) == getattr(glm5, f) for f in same)


@pytest.mark.parametrize("name, gpu, max_weights_gib", [
    ("dsv32-rank-ep8", "h200", 100), ("dsv32-rank-ep16", "h100", 60), ("glm5-rank-ep8", "h200", 110)])
def test_rank_configs_fit_their_gpu(name, gpu, max_weights_gib):
    """The planner's FP8 weights per GPU leave a positive KV budget at the server's mem_fraction_static 0.85 and
    fit more HiSparse than dense requests at 32K (FP8 KV rows)."""
    raw, _ = read_config_json(name)
    engine = EngineConfig(device="cuda", kv_cache_dtype="fp8_e4m3", context_length=32768, max_running_requests=512)
    plan = make_plan(raw, engine, model_name=name, device_memory=GPU_MEMORY[gpu], host_memory=None)
    assert plan.quantization == "fp8"
    assert plan.weights_bytes_per_gpu < max_weights_gib * GIB
    assert plan.kv_budget_bytes_per_gpu > 5 * GIB
    assert 1 <= plan.dense.max_requests < plan.hisparse.max_requests


def test_random_fp8_fill_draws_on_the_target_device():
    """A reduced-layer rank model built and filled with random FP8 weights while the default device is `meta`:
    any tensor the fill drew without naming the target device would land on meta and fail to copy, so every draw
    happens where the weights live (on CUDA: no host round trip)."""
    bench = _load("bench_decode")
    config = bench.reduced_layers(load_config("dsv32-rank-ep16"), 4)
    config = dataclasses.replace(config, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                                 vocab_size=1024, num_attention_heads=16, q_lora_rank=256)
    assert config.num_hidden_layers == 4 and sum(config.is_moe_layer(i) for i in range(4)) == 1
    model = build_empty_model(config, "cpu", torch.float32, fp8=True)
    with torch.device("meta"):
        randomize_weights(model, seed=0)
    state = model.state_dict()
    assert all(t.device.type == "cpu" for t in state.values())
    fp8 = [t for t in state.values() if t.dtype == FP8_DTYPE]
    assert len(fp8) > 10 and all(t.float().abs().sum() > 0 for t in fp8)
    assert len(model.model.layers) == 4


def test_bench_planned_memory_and_floor(tmp_path, monkeypatch):
    """`--smoke --plan-memory`: the device budget is the engine's own (memory.device_kv_budget; on the CPU its
    fixed budget, shrunk here), the same for dense and HiSparse; HiSparse's host pool holds exactly the batch the
    device budget holds; every run reports weights, budget and a floor that is the roofline arithmetic of its own
    bytes; the sweep runs at its own budget."""
    budget = 24 << 20
    monkeypatch.setattr(memory, "CPU_DEFAULT_DEVICE_BUDGET", budget)
    bench = _load("bench_decode")
    roofline = sys.modules["roofline"]
    out = tmp_path / "r.json"
    argv = ["--smoke", "--plan-memory", "--contexts", "1024", "--miss-rates", "0.05", "--skip-model-indexer-run",
            "--batch-sizes", "--sweep-kv-gib-per-layer", str(6 / 1024), "--sweep-context", "512",
            "--out", str(out), "--plot", str(tmp_path / "r.png")]
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    results, args = data["results"], data["meta"]["args"]
    assert all("error" not in r for r in results), results
    main = {r["mode"]: r for r in results if r["sweep_kv_gib_per_layer"] is None}
    dense, sparse = main["dense"], main["hisparse-m5"]
    assert dense["kv_budget_bytes"] == sparse["kv_budget_bytes"] == args["kv_budget_bytes"] == budget
    assert 1 <= dense["batch"] < sparse["batch"]
    assert sparse["batch"] == sparse["device_bound_batch"] and not sparse["host_binds"]
    assert sparse["host_pool_for_device_batch_bytes"] == sparse["batch"] * sparse["host_bytes_per_request"]
    config = load_config("tiny-dsa")
    geometry = CacheGeometry.from_model_config(config)
    roof = args["roof"]
    for r in results:
        kv_dtype = memory.resolve_kv_dtype(EngineConfig(kv_cache_dtype="auto"), torch.float32)
        assert r["floor_kv_bytes"] == roofline.kv_bytes_read(
            r["batch"], r["context"], geometry.num_layers, geometry.num_index_layers, config.index_topk,
            geometry.row_bytes(kv_dtype), geometry.index_key_bytes)
        split = roofline.WeightSplit(**roof["weight_split"])
        assert r["floor_weight_bytes"] == pytest.approx(roofline.weight_bytes_read(split, r["batch"]))
        assert r["floor_miss_bytes"] == r["h2d_bytes_per_step"]
        expect = ((r["floor_weight_bytes"] + r["floor_kv_bytes"]) / roof["hbm_gbps"]
                  + r["floor_miss_bytes"] / roof["pcie_gbps"]) / 1e6
        assert r["floor_ms"] == pytest.approx(expect) and r["step_over_floor"] == pytest.approx(
            r["step_ms"] / r["floor_ms"])
        assert r["weights_gib"] == pytest.approx(roof["weights_bytes"] / GIB)
    assert sparse["floor_miss_bytes"] > 0 and dense["floor_miss_bytes"] == 0
    sweep = [r for r in results if r["sweep_kv_gib_per_layer"] is not None]
    assert {r["mode"] for r in sweep} == {"dense", "hisparse-m5"}
    assert all(r["kv_budget_bytes"] == int(6 / 1024 * geometry.num_layers * GIB) and r["context"] == 512
               for r in sweep)
    assert (tmp_path / "r_sweep.png").stat().st_size > 0


@pytest.mark.gpu
def test_rank_model_builds_on_the_gpu_in_seconds(tmp_path):
    """dsv32-rank-ep16 cut to 8 layers (real dims, 16 FP8 experts): built and randomized on the GPU in under a
    minute, holding on the device no more than its weights plus one draw of its largest tensor at a time (float32
    values and their cast: 5 bytes an element; drawing everything in float32 first would need 4x the weights);
    then a short planned-memory bench run at 4K reports a floor."""
    import time

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from decode_server.model import build_random_model
    from decode_server.model.weights import weight_bytes

    bench = _load("bench_decode")
    config = bench.reduced_layers(load_config("dsv32-rank-ep16"), 8)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    model = build_random_model(config, "cuda", torch.bfloat16, quantization="fp8")
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    stored = weight_bytes(model)["total"]
    largest = max(t.numel() for t in model.state_dict().values())
    peak = torch.cuda.max_memory_allocated() - base
    print(f"rank model (8 layers): built in {elapsed:.1f} s, stored {stored / 2**30:.2f} GiB, largest tensor "
          f"{largest / 2**20:.0f} Mi elements, peak {peak / 2**30:.2f} GiB ({(peak - stored) / 2**20:.0f} MiB over)")
    assert elapsed < 60, elapsed
    assert torch.cuda.memory_allocated() - base <= stored + (64 << 20)
    assert peak <= stored + 5 * largest + (256 << 20)
    del model
    torch.cuda.empty_cache()
    out = tmp_path / "r.json"
    assert bench.main(["--config", "dsv32-rank-ep16", "--num-layers", "8", "--contexts", "4096", "--steps", "3",
                       "--warmup", "1", "--miss-rates", "0.05", "--skip-model-indexer-run", "--batch-sizes",
                       "--max-batch", "16", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert all("error" not in r and r["floor_ms"] > 0 and r["step_over_floor"] > 0 for r in results), results


def test_rank_summary_table_and_merged_plots(tmp_path, capsys):
    """rank_summary.py over two stages' JSON: one line a run with HiSparse / dense at the same context (batch-1 and
    failed runs named, not divided), and with --plot one tok/s-against-context figure across both files plus the
    sweep's ratio figure."""
    pytest.importorskip("matplotlib")

    def run(mode, context, batch, tps, fixed=None, sweep=None):
        return {"mode": mode, "context": context, "batch": batch, "fixed_batch": fixed, "tokens_per_s": tps,
                "kv_budget_gib": 20.0, "step_ms": 1000 * batch / tps, "floor_ms": 10.0, "step_over_floor": 2.0,
                "hit_rate": 0.95 if mode.startswith("hisparse") else None, "sweep_kv_gib_per_layer": sweep}

    (tmp_path / "rank_32k.json").write_text(json.dumps({"results": [
        run("dense", 32768, 14, 200.0), run("hisparse-m5", 32768, 51, 500.0), run("dense", 32768, 1, 20.0, fixed=1),
        {"mode": "hisparse-m15", "context": 32768, "error": "CUDA error: out of memory"}]}))
    (tmp_path / "rank_sweep.json").write_text(json.dumps({"results": [
        run("dense", 32768, 10, 600.0, sweep=0.25), run("hisparse-m5", 32768, 37, 1500.0, sweep=0.25),
        run("dense", 32768, 20, 1000.0, sweep=0.5), run("hisparse-m5", 32768, 70, 2000.0, sweep=0.5)]}))
    summary = _load("rank_summary")
    assert summary.main([str(tmp_path), "--plot", str(tmp_path / "ctx.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if "hisparse-m5 " in line and "rank_32k" in line)
    assert row.split()[6] == "2.50"
    assert any("dense@B1" in line and line.split()[6] == "-" for line in lines)
    assert any("hisparse-m15" in line and "error: CUDA error" in line for line in lines)
    assert any("hisparse-m5@0.5G/L" in line and line.split()[6] == "2.00" for line in lines)
    assert len(summary.merged_results(tmp_path)) == 6  # batch-1 and failed runs left out of the plots
    assert (tmp_path / "ctx.png").stat().st_size > 0 and (tmp_path / "ctx_sweep.png").stat().st_size > 0
