"""The memory planner (`decode-server plan`) against what the engine really allocates and admits.

The planner reads config.json (and, given a checkpoint, its safetensors headers); the engine here is built for real
(tiny-dsa, tiny-glm5 loaded from their checkpoints, FP8 kept in FP8 on CPU through the model API) or, for the bench
configs (billions of parameters), around the same model built on the meta device (no memory, same module tree),
with explicit small budgets on CPU.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

from decode_server.cli import main
from decode_server.config import EngineConfig, HiSparseConfig
from decode_server.engine.engine import Engine
from decode_server.engine.kv_sizing import hisparse_bytes
from decode_server.engine.sampling_params import SamplingParams
from decode_server.model import load_config, load_model, resolve_model_path
from decode_server.model.construct import build_empty_model
from decode_server.model.fp8 import scale_shape
from decode_server.model.loader import checkpoint_fp8_projections
from decode_server.model.quantization import (
    Fp8LayoutError,
    checkpoint_block,
    is_fp8_projection,
    resolve_quantization,
    wants_fp8,
)
from decode_server.model.weights import planned_weight_bytes, weight_bytes
from decode_server.parallel.state import ParallelState
from decode_server.planner import GPU_MEMORY, make_plan, read_config_json

BENCH_CONFIGS = ["dsv32-bench", "dsv32-bench-16l", "glm5-bench", "glm5-shared-bench"]
HS = HiSparseConfig(device_buffer_size=64, num_recent_slots=2)


def _plan(name: str, **fields):
    return make_plan(read_config_json(name)[0], EngineConfig(**fields), model_name=name)


def _check_pools_match(engine: Engine, plan) -> None:
    """The planner's pool sizes and bytes are the engine's own tensors."""
    kv = engine.kv
    if engine.config.enable_hisparse:
        lay, hs = kv.layout, plan.hisparse
        assert (lay.num_buffers, lay.host_pages, lay.indexer_pages, lay.prefill_staging_rows) == (
            hs.num_buffers, hs.host_pages, hs.indexer_pages, hs.prefill_staging_rows)
        staging = kv.staging.nbytes if kv.staging is not None else 0
        assert kv.buffers.nbytes + kv.indexer.nbytes + staging == hs.device_pool_bytes
        assert kv.host.nbytes == hs.host_pool_bytes == hisparse_bytes(lay).host_pool
        tables = (kv.host.rows.table, kv.indexer.rows.table, kv.buffers.buffer_slots, kv.buffers.buffer_tokens,
                  kv.buffers.lru_order, kv.buffers._identity)
        assert sum(t.numel() * t.element_size() for t in tables) == hs.table_bytes
    else:
        cache = kv.cache
        assert cache.allocator.num_slots == plan.dense.slots
        assert sum(t.numel() * t.element_size() for t in (cache.kv, cache.index_keys, cache.index_scales)) == (
            plan.dense.pool_bytes)
        assert cache.tokens.table.numel() * 4 == plan.dense.table_bytes
    assert engine.kv_budgets.device == plan.kv_budget_bytes_per_gpu
    stats = engine.stats()
    assert stats.weights_bytes == engine.weight_bytes["total"] == plan.weights_bytes_per_gpu
    assert stats.weights_bytes_by_kind == plan.weights_by_kind
    assert stats.quantization == plan.quantization
    assert stats.device_kv_budget_bytes == plan.kv_budget_bytes_per_gpu


@pytest.fixture(scope="module")
def tiny_glm5_cpu():
    return load_model("tiny-glm5", "cpu", torch.float32)


@pytest.mark.parametrize("hisparse", [False, True])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_tiny_models_weights_and_pools_equal_the_engines(tiny_cpu, tiny_glm5_cpu, hisparse, kv_cache_dtype):
    fields = dict(device="cpu", page_size=16, chunked_prefill_size=128, device_kv_budget_bytes=24 << 20,
                  host_kv_budget_bytes=48 << 20, enable_hisparse=hisparse, hisparse=HS, context_length=2048,
                  kv_cache_dtype=kv_cache_dtype)
    for name, (model, config) in (("tiny-dsa", tiny_cpu[:2]), ("tiny-glm5", tiny_glm5_cpu)):
        engine = Engine(EngineConfig(**fields), model=model, model_config=config, tokenizer=None)
        plan = _plan(name, **fields)
        assert plan.quantization == "none" and plan.model_dtype == "float32"  # CPU dequantizes
        _check_pools_match(engine, plan)


@pytest.mark.parametrize("name", BENCH_CONFIGS)
@pytest.mark.parametrize("hisparse", [False, True])
def test_bench_configs_weights_and_pools_equal_the_engines(name, hisparse):
    """The engine around the bench model built on the meta device: its parameters and buffers are what a GPU
    holds in bf16 (4-16 billion parameters, not allocated here), its pools are real (small budgets)."""
    config = load_config(name)
    model = build_empty_model(config, "meta", torch.bfloat16)
    model.finalize_weights()
    fields = dict(device="cpu", dtype="bfloat16", kv_cache_dtype="fp8_e4m3", device_kv_budget_bytes=96 << 20,
                  host_kv_budget_bytes=192 << 20, enable_hisparse=hisparse, context_length=8192)
    engine = Engine(EngineConfig(**fields), model=model, model_config=config, tokenizer=None)
    plan = _plan(name, **fields)
    assert plan.weights_bytes_per_gpu == weight_bytes(model)["total"]
    _check_pools_match(engine, plan)


@pytest.mark.parametrize("name", ["tiny-dsa", "tiny-glm5", "dsv32-bench", "glm5-shared-bench"])
@pytest.mark.parametrize("ep_size", [1, 2])
@pytest.mark.parametrize("fp8", [False, True])
def test_tensor_parallel_weights_equal_each_ranks_model(name, ep_size, fp8):
    """Per GPU with TP=2 (experts tensor-sharded or split), bf16 or every projection in FP8: every rank's whole
    model, built layer by layer, holds what the planner computes from one layer of each kind; where the engine
    refuses FP8 storage (a piece cuts through a 128-block) the planner refuses it too."""
    config = load_config(name)
    try:
        plan = planned_weight_bytes(config, torch.bfloat16, tp_size=2, ep_size=ep_size, fp8=fp8)
    except Fp8LayoutError:
        with pytest.raises(Fp8LayoutError):
            build_empty_model(config, "meta", torch.bfloat16, ParallelState(0, 2, ep_size), fp8=fp8)
        assert fp8 and name.startswith("tiny")  # tiny experts of 128 (tiny-glm5: 64) split in two
        return
    for rank in range(2):
        model = build_empty_model(config, "meta", torch.bfloat16, ParallelState(rank, 2, ep_size), fp8=fp8)
        model.finalize_weights()
        assert weight_bytes(model) == {**plan.by_kind, "total": plan.total}
    single = planned_weight_bytes(config, torch.bfloat16, fp8=fp8)
    assert plan.total < single.total < 2 * plan.total  # sharded, plus what every rank replicates


@pytest.mark.parametrize("name", ["tiny-dsa", "tiny-glm5", "dsv32-bench"])
def test_dp_attention_weights_equal_each_ranks_model(name):
    """With --enable-dp-attention every rank holds the whole attention (replicated) and its share of the rest: the
    planner's count is every DP rank's whole model, and more than tensor-parallel attention's."""
    config = load_config(name)
    plan = planned_weight_bytes(config, torch.bfloat16, tp_size=2, ep_size=2, dp_size=2)
    for rank in range(2):
        model = build_empty_model(config, "meta", torch.bfloat16, ParallelState(rank, 2, 2, dp_size=2))
        model.finalize_weights()
        assert weight_bytes(model) == {**plan.by_kind, "total": plan.total}
    assert plan.total > planned_weight_bytes(config, torch.bfloat16, tp_size=2, ep_size=2).total


# -- FP8 weights as stored --------------------------------------------------------------------------------------

def test_fp8_weights_count_one_byte_plus_block_scales():
    config = load_config("tiny-dsa")
    fp8 = planned_weight_bytes(config, torch.bfloat16, fp8=True)
    bf16 = planned_weight_bytes(config, torch.bfloat16)
    model = build_empty_model(config, "meta", torch.bfloat16)
    quantized = {n: t.shape for n, t in model.state_dict().items() if is_fp8_projection(n)}
    elements = sum(s.numel() for s in quantized.values())
    scales = sum(4 * r * c for r, c in (scale_shape(tuple(s), (128, 128)) for s in quantized.values()))
    assert fp8.by_kind["fp8"] == elements and fp8.by_kind["fp8_scales"] == scales
    # The absorbed products: bf16 W_UK and W_UV (2 bytes × kv_b_proj's values) against, with FP8 storage (tiny-dsa's
    # heads are whole 128-blocks), only the FP8 W_UKᵀ copy (nope rows × latent) and its scales: W_UV is a view.
    heads, nope, v, lora = (config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim,
                            config.kv_lora_rank)
    layers = config.num_hidden_layers
    assert bf16.by_kind["absorbed"] == layers * 2 * heads * (nope + v) * lora
    assert fp8.by_kind["absorbed"] == layers * (heads * nope * lora + 4 * heads * (nope // 128) * (lora // 128))
    assert bf16.total - fp8.total == elements - scales + bf16.by_kind["absorbed"] - fp8.by_kind["absorbed"]
    assert fp8.parameters == bf16.parameters and (fp8.quantization, bf16.quantization) == ("fp8", "none")


def test_fp8_weights_equal_the_loaded_fp8_model():
    """tiny-dsa loaded with FP8 storage (the model API keeps FP8 on CPU; the engine on CUDA keeps the same): its
    bytes by kind are what the planner computes from the checkpoint's headers, on the meta device; `plan` given
    the checkpoint directory plans them, and without one it takes every projection as FP8."""
    path = resolve_model_path("tiny-dsa")
    loaded, config = load_model("tiny-dsa", "cpu", torch.bfloat16, quantization="fp8")
    names = checkpoint_fp8_projections(path, config)
    planned = planned_weight_bytes(config, torch.bfloat16, fp8=names)
    assert weight_bytes(loaded) == {**planned.by_kind, "total": planned.total}
    assert planned.by_kind["fp8"] > 0
    # A checkpoint that stores layers of one kind differently (layer 2's q_b_proj bf16, layer 1's FP8) is counted
    # layer by layer: the planner's one-layer-per-kind model splits that kind.
    mixed = names - {"model.layers.2.self_attn.q_b_proj.weight"}
    whole = build_empty_model(config, "meta", torch.bfloat16, fp8=mixed)
    whole.finalize_weights()
    planned_mixed = planned_weight_bytes(config, torch.bfloat16, fp8=mixed)
    assert weight_bytes(whole) == {**planned_mixed.by_kind, "total": planned_mixed.total} != weight_bytes(loaded)
    fields = dict(device="cuda", device_kv_budget_bytes=64 << 20, host_kv_budget_bytes=256 << 20)
    raw = read_config_json("tiny-dsa")[0]
    plan = make_plan(raw, EngineConfig(**fields), model_name="tiny-dsa", checkpoint=path)
    assert plan.quantization == "fp8" and plan.model_dtype == "bfloat16"
    assert plan.weights_bytes_per_gpu == planned.total and "checkpoint" in plan.fp8_projections
    convention = make_plan(raw, EngineConfig(**fields), model_name="tiny-dsa")
    kv_a = [t.shape for n, t in loaded.state_dict().items() if n.endswith("kv_a_proj_with_mqa.weight")]
    kv_a_scales = sum(4 * r * c for r, c in (scale_shape(tuple(shape), (128, 128)) for shape in kv_a))
    # bf16 in this checkpoint, FP8 by the convention: 2 bytes → 1 byte + block scales
    assert plan.weights_bytes_per_gpu - convention.weights_bytes_per_gpu == sum(s.numel() for s in kv_a) - kv_a_scales
    none = make_plan(raw, EngineConfig(**fields, quantization="none"), model_name="tiny-dsa")
    assert none.quantization == "none" and none.weights_by_kind["fp8"] == 0


def test_fp8_weight_rule_matches_the_checkpoint_writer():
    """tiny-dsa's generated checkpoint stores in FP8 exactly the tensors the rule names, except
    kv_a_proj_with_mqa: its 576 rows give ragged blocks that transformers cannot read, so the writer keeps it bf16
    (real DeepSeek-V3.2 checkpoints store it in FP8: docs/deploy.md "Planning memory")."""
    path = resolve_model_path("tiny-dsa")
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        stored_fp8 = {n for n in names if handle.get_slice(n).get_dtype() == "F8_E4M3"}
        for n in stored_fp8:
            assert tuple(handle.get_slice(n + "_scale_inv").get_shape()) == scale_shape(
                tuple(handle.get_slice(n).get_shape()), (128, 128))
    assert checkpoint_fp8_projections(path, load_config("tiny-dsa")) == stored_fp8
    by_rule = {n for n in names if is_fp8_projection(n)}
    assert stored_fp8 <= by_rule
    assert {n.rsplit(".", 2)[-2] for n in by_rule - stored_fp8} == {"kv_a_proj_with_mqa"}
    assert not any(is_fp8_projection(n) for n in ("model.layers.1.mlp.gate.weight", "lm_head.weight",
                                                  "model.layers.0.self_attn.indexer.weights_proj.weight",
                                                  "model.embed_tokens.weight",
                                                  "model.layers.0.input_layernorm.weight"))


def test_fp8_pieces_that_cut_through_blocks_are_dequantized_under_auto():
    """The engine's rule at a tensor-parallel size whose pieces cut through 128-blocks (tiny-dsa's 128-wide experts
    at TP=2): "auto" dequantizes every FP8 weight (the plan says so), "fp8" is refused with the loader's error."""
    raw = read_config_json("tiny-dsa")[0]
    fields = dict(device="cuda", tp_size=2, device_kv_budget_bytes=64 << 20)
    plan = make_plan(raw, EngineConfig(**fields), model_name="tiny-dsa")
    assert plan.quantization == "none" and plan.weights_by_kind["fp8"] == 0
    assert "dequantizes every FP8 weight" in plan.warnings[-1] and "not a multiple of 128" in plan.warnings[-1]
    assert plan.weights_bytes_per_gpu == planned_weight_bytes(load_config("tiny-dsa"), torch.bfloat16, 2).total
    with pytest.raises(Fp8LayoutError, match="--quantization none"):
        make_plan(raw, EngineConfig(**fields, quantization="fp8"), model_name="tiny-dsa")


def test_quantization_default_rule():
    """The engine's `--quantization` rule, which the planner applies: auto keeps a block-FP8 checkpoint in FP8 on
    CUDA only, fp8 insists (and needs a block-FP8 checkpoint), none and the CPU dequantize."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    fp8_config, bf16_config = load_config("deepseek-v3.2"), load_config("dsv32-bench")
    assert checkpoint_block(fp8_config) == (128, 128) and checkpoint_block(bf16_config) is None
    assert resolve_quantization(None, cuda) == resolve_quantization("auto", cuda) == "auto"
    assert resolve_quantization("fp8", cpu) == resolve_quantization(None, cpu) == "none"  # CPU always dequantizes
    assert wants_fp8("auto", fp8_config, cuda) and not wants_fp8("auto", fp8_config, cpu)
    assert not wants_fp8("none", fp8_config, cuda) and not wants_fp8("auto", bf16_config, cuda)
    with pytest.raises(ValueError, match="needs a block-FP8 checkpoint"):
        wants_fp8("fp8", bf16_config, cuda)
    awq = dataclasses.replace(fp8_config, quantization_config={"quant_method": "awq"})
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported"):
        wants_fp8("auto", awq, cuda)
    raw = {**read_config_json("tiny-dsa")[0], "quantization_config": {"quant_method": "awq"}}
    for device, quantization in (("cpu", None), ("cuda", "none")):  # refused in every mode, as the loader does
        with pytest.raises(ValueError, match="quant_method 'awq' is not supported"):
            make_plan(raw, EngineConfig(device=device, quantization=quantization, device_kv_budget_bytes=1 << 30),
                      model_name="awq")
    plans = {q: _plan("deepseek-v3.2", device="cuda", tp_size=8, device_kv_budget_bytes=1 << 30, quantization=q)
             for q in ("auto", "fp8", "none")}
    assert [plans[q].quantization for q in ("auto", "fp8", "none")] == ["fp8", "fp8", "none"]
    cpu_plan = _plan("deepseek-v3.2", device="cpu", tp_size=8, quantization="fp8")
    assert cpu_plan.quantization == "none" and "dequantizes" in cpu_plan.warnings[0]


# -- capacity: what the scheduler admits ------------------------------------------------------------------------

CONTEXT = 256  # tokens per request: prompt 255 + 1 generated, 255 tokens of KV = 16 pages of 16


@pytest.mark.parametrize(("hisparse", "budgets", "limit"), [
    (False, dict(device_kv_budget_bytes=6 << 20), "device KV cache"),
    (False, dict(device_kv_budget_bytes=16 << 20, max_running_requests=3), "max_running_requests"),
    (True, dict(device_kv_budget_bytes=6 << 20, host_kv_budget_bytes=64 << 20), "device buffers"),
    (True, dict(device_kv_budget_bytes=16 << 20, host_kv_budget_bytes=4 << 20), "host KV pool"),
    (True, dict(device_kv_budget_bytes=2 << 20, host_kv_budget_bytes=64 << 20), "GPU indexer keys"),
    (True, dict(device_kv_budget_bytes=16 << 20, host_kv_budget_bytes=64 << 20, max_running_requests=3),
     "max_running_requests"),
])
def test_max_requests_is_what_the_scheduler_admits(make_engine, hisparse, budgets, limit):
    """n = the planner's max_requests at CONTEXT: n requests of that length are admitted at once, the next one
    waits until one finishes, and all complete without a retraction."""
    fields = dict(device="cpu", page_size=16, chunked_prefill_size=128, hisparse=HS, context_length=CONTEXT,
                  enable_hisparse=hisparse, **budgets)
    plan = _plan("tiny-dsa", **fields)
    mode = plan.hisparse if hisparse else plan.dense
    n = plan.max_requests["hisparse" if hisparse else "dense"]
    assert mode.limit == limit and n >= 2
    engine = make_engine(**{k: v for k, v in fields.items() if k != "device"})
    _check_pools_match(engine, plan)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for i in range(n + 1):
        engine.add_request(f"r{i}", [(7 * i + j) % 1000 + 3 for j in range(CONTEXT - 1)], params)
    engine.step()
    assert engine.stats().num_running_reqs == n and len(engine.scheduler.waiting) == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_retractions == 0 and engine.is_idle_and_empty()


def test_best_hisparse_host_pool_holds_its_batch():
    """best_max_requests with best_host_kv_budget_bytes as the host budget is what the layout then holds."""
    fields = dict(device="cpu", page_size=16, hisparse=HS, context_length=CONTEXT, device_kv_budget_bytes=6 << 20,
                  host_kv_budget_bytes=64 << 20)
    plan = _plan("tiny-dsa", **fields)
    best = plan.hisparse.best_max_requests
    assert best >= plan.hisparse.max_requests
    again = _plan("tiny-dsa", **{**fields, "host_kv_budget_bytes": plan.hisparse.best_host_kv_budget_bytes})
    assert again.hisparse.max_requests == best
    more = _plan("tiny-dsa", **{**fields, "host_kv_budget_bytes": 10 * plan.hisparse.best_host_kv_budget_bytes})
    assert more.hisparse.max_requests <= best  # a larger host pool takes device memory for indexer keys


# -- the command ------------------------------------------------------------------------------------------------

def _run_plan(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_command_deepseek_v32_on_h200(capsys):
    out = _run_plan(capsys, "--model-path", "deepseek-v3.2", "--tp-size", "8", "--ep-size", "8",
                    "--device-memory", "H200", "--kv-cache-dtype", "fp8_e4m3", "--context-length", "32768",
                    "--max-running-requests", "256")
    for key in ("weights_bytes_per_gpu", "kv_budget_bytes_per_gpu", "max_requests", "kv_bytes_per_token"):
        assert key in out
    assert out["quantization"] == "fp8" and out["device_memory_bytes"] == GPU_MEMORY["h200"]
    assert sum(out["weights_by_kind"].values()) == out["weights_bytes_per_gpu"]
    assert out["kv_budget_bytes_per_gpu"] == int(
        GPU_MEMORY["h200"] - out["weights_bytes_per_gpu"] - out["runtime_memory_bytes"] - (1.0 - 0.85) * GPU_MEMORY["h200"])
    assert out["kv_bytes_per_token"] == {"dense": 61 * (656 + 132), "hisparse_device": 61 * 132,
                                         "hisparse_host": 61 * 656}
    dense, hs = out["max_requests"]["dense"], out["max_requests"]["hisparse"]
    assert 0 < dense < hs <= out["hisparse"]["best_max_requests"]
    assert out["dense"]["slots"] // (32768 // 64) // 64 == dense  # whole requests of 512 pages
    assert not out["warnings"]
    bf16 = _run_plan(capsys, "--model-path", "deepseek-v3.2", "--tp-size", "8", "--device-memory", "H200",
                     "--quantization", "none")
    assert bf16["weights_bytes_per_gpu"] > 1.9 * out["weights_bytes_per_gpu"]
    assert bf16["max_requests"] == {"dense": 0, "hisparse": 0} and "leave no KV budget" in bf16["warnings"][0]


def test_plan_reports_dp_attention_capacity_next_to_tensor_parallel(capsys):
    """At TP8 both attention layouts are planned: DP attention's node holds 8 ranks' requests (each rank its own
    KV, its own host pool from its own budget), TP's one GPU's; asking for either layout gives the same two."""
    args = ["--model-path", "deepseek-v3.2", "--tp-size", "8", "--ep-size", "8", "--device-memory", "H200",
            "--kv-cache-dtype", "fp8_e4m3", "--context-length", "32768", "--max-running-requests", "256"]
    tp = _run_plan(capsys, *args)
    dp = _run_plan(capsys, *args, "--enable-dp-attention", "--dp-size", "8")
    assert tp["dp_size"] == 1 and dp["dp_size"] == 8
    assert tp["node_max_requests"] == dp["node_max_requests"]
    assert tp["node_max_requests"]["tensor_parallel"] == tp["max_requests"]
    assert dp["node_max_requests"]["dp_attention"] == {k: 8 * v for k, v in dp["max_requests"].items()}
    # Replicated attention weights leave each rank less KV budget, but the node holds far more requests.
    assert dp["weights_bytes_per_gpu"] > tp["weights_bytes_per_gpu"]
    assert dp["kv_budget_bytes_per_gpu"] < tp["kv_budget_bytes_per_gpu"]
    for mode in ("dense", "hisparse"):
        assert dp["node_max_requests"]["dp_attention"][mode] > 4 * tp["node_max_requests"]["tensor_parallel"][mode]
    # A derived host pool capped by the host's memory is shared by the 8 ranks' pools.
    capped = _run_plan(capsys, *args, "--enable-dp-attention", "--dp-size", "8", "--host-memory", "512GiB")
    assert capped["hisparse"]["host_kv_budget_bytes"] == (256 << 30) // 8
    assert main(["plan", *args, "--enable-dp-attention", "--dp-size", "8"]) == 0
    text = capsys.readouterr().out
    assert "--enable-dp-attention --dp-size 8" in text and "one pool per rank" in text
    with pytest.raises(SystemExit):
        main(["plan", *args, "--enable-dp-attention", "--dp-size", "4"])
    capsys.readouterr()


def test_plan_command_text_and_errors(capsys):
    assert main(["plan", "--model-path", "glm-5", "--tp", "8", "--device-memory", "141GiB"]) == 0
    text = capsys.readouterr().out
    assert "largest batch at 202752 tokens" in text and "KV budget" in text
    assert "num_attention_heads / tp_size 8 = 8" in text  # GLM-5's 64 heads are 8 per rank at TP8
    cpu = _run_plan(capsys, "--model-path", "tiny-dsa", "--device", "cpu")
    assert cpu["quantization"] == "none" and cpu["kv_budget_source"] == "CPU default"
    # A checkpoint directory: its headers say which projections are FP8 (tiny-dsa keeps kv_a_proj_with_mqa bf16).
    checkpoint = _run_plan(capsys, "--model-path", str(resolve_model_path("tiny-dsa")), "--device-kv-budget", "64MiB",
                           "--quantization", "auto")
    bundled = _run_plan(capsys, "--model-path", "tiny-dsa", "--device-kv-budget", "64MiB")
    assert checkpoint["quantization"] == bundled["quantization"] == "fp8"
    assert "checkpoint" in checkpoint["fp8_projections"] and "no checkpoint" in bundled["fp8_projections"]
    assert checkpoint["weights_bytes_per_gpu"] > bundled["weights_bytes_per_gpu"]
    for bad in (["--model-path", "deepseek-v3.2"],  # no device memory
                ["--model-path", "no-such-model", "--device", "cpu"],
                ["--model-path", "dsv32-bench", "--quantization", "fp8", "--device-memory", "H100"],
                ["--model-path", "tiny-dsa", "--device-memory", "lots"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["plan", *bad])
        assert exit_info.value.code == 2
    capsys.readouterr()


# -- on a GPU: the KV budget the engine measures --------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("hisparse", [False, True])
def test_gpu_budget_and_pools_equal_the_engines(hisparse):
    """On CUDA with --mem-fraction-static: given the device's total memory and what is in use besides the weights
    when the engine sizes its pools (measured here just before), the planner's KV budget, pools and weights are the
    engine's; and the planner's default runtime-memory estimate covers what was in use (printed for the docs)."""
    import gc

    from decode_server.model import build_random_model
    from decode_server.planner import DEFAULT_RUNTIME_MEMORY

    name = "dsv32-bench"  # bf16 checkpoint config: the weights stay bf16 on the GPU
    config = load_config(name)
    gc.collect()
    torch.cuda.empty_cache()
    # Tensors that earlier tests of this process still hold (caches, fixtures): in use, but no part of what a
    # server process has besides its weights, so not held against the planner's runtime estimate.
    leftover = torch.cuda.memory_allocated()
    model = build_random_model(config, "cuda", torch.bfloat16, seed=0)
    fields = dict(device="cuda", kv_cache_dtype="fp8_e4m3", context_length=32768, enable_hisparse=hisparse,
                  host_kv_budget_bytes=4 << 30, disable_cuda_graph=True)
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    runtime = total - free - weight_bytes(model)["total"]
    engine = Engine(EngineConfig(**fields), model=model, model_config=config, tokenizer=None)
    plan = make_plan(read_config_json(name)[0], EngineConfig(**fields), model_name=name, device_memory=total,
                     runtime_memory=runtime)
    print(f"{torch.cuda.get_device_name()}: total {total / 2**20:.0f} MiB, weights "
          f"{engine.weight_bytes['total'] / 2**20:.0f} MiB, runtime memory {runtime / 2**20:.0f} MiB (of which "
          f"{leftover / 2**20:.0f} MiB earlier tests' tensors), KV budget engine "
          f"{engine.kv_budgets.device / 2**20:.0f} MiB, planner {plan.kv_budget_bytes_per_gpu / 2**20:.0f} MiB")
    assert abs(engine.kv_budgets.device - plan.kv_budget_bytes_per_gpu) <= 4 << 20  # nothing allocated between
    assert 0 < runtime - leftover <= DEFAULT_RUNTIME_MEMORY
    plan = make_plan(read_config_json(name)[0], EngineConfig(**fields, device_kv_budget_bytes=engine.kv_budgets.device),
                     model_name=name)
    _check_pools_match(engine, plan)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fp8_weights_equal_the_engines():
    """On CUDA with the default --quantization (auto): the engine loads tiny-dsa's block-FP8 checkpoint keeping its
    FP8 projections in FP8; the plan given the checkpoint directory holds the same bytes, kind by kind."""
    path = resolve_model_path("tiny-dsa")
    fields = dict(device="cuda", model_path="tiny-dsa", device_kv_budget_bytes=64 << 20,
                  host_kv_budget_bytes=256 << 20, disable_cuda_graph=True)
    engine = Engine(EngineConfig(**fields))
    plan = make_plan(read_config_json("tiny-dsa")[0], EngineConfig(**fields), model_name="tiny-dsa", checkpoint=path)
    stats = engine.stats()
    assert stats.quantization == plan.quantization == "fp8"
    assert stats.weights_bytes == plan.weights_bytes_per_gpu and stats.weights_bytes_by_kind == plan.weights_by_kind
    _check_pools_match(engine, plan)


def test_docs_deploy_table_is_the_planners_output():
    """docs/deploy.md's table of DeepSeek-V3.2 and GLM-5 on 8 GPUs is what the planner computes today."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "deploy.md").read_text()
    text = text[:text.index("With data-parallel attention (`--enable-dp-attention --dp-size 8`")]  # the TP table
    rows = [line.split("|")[1:-1] for line in text.splitlines()
            if line.startswith(("| DeepSeek-V3.2 | H200", "| GLM-5 | H200"))]
    assert len(rows) == 8
    gib = 1 << 30
    for model, gpu, tp_ep, context, weights, budget, dense, hisparse, best in (
            [cell.strip() for cell in row] for row in rows):
        tp, ep = (int(x) for x in tp_ep.split(" / "))
        fields = dict(device="cuda", kv_cache_dtype="fp8_e4m3", tp_size=tp, ep_size=ep, max_running_requests=512,
                      context_length=int(context.removesuffix("K")) * 1024)
        name = {"DeepSeek-V3.2": "deepseek-v3.2", "GLM-5": "glm-5"}[model]
        plan = make_plan(read_config_json(name)[0], EngineConfig(**fields), model_name=name,
                         device_memory=GPU_MEMORY[gpu.lower()])
        h = plan.hisparse
        assert weights == f"{plan.weights_bytes_per_gpu / gib:.1f}" and budget == f"{plan.kv_budget_bytes_per_gpu / gib:.1f}"
        assert dense == str(plan.max_requests["dense"])
        assert hisparse.startswith(f"{h.max_requests} ({h.host_kv_budget_bytes / gib:.0f} GiB;")
        assert best == f"{h.best_max_requests} ({h.best_host_kv_budget_bytes / gib:.0f} GiB)"


def test_docs_deploy_dp_attention_table_is_the_planners_output():
    """docs/deploy.md's DP-attention table (DeepSeek-V3.2 and GLM-5, 8×H200, --dp-size 8) is what the planner computes."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "deploy.md").read_text()
    start = text.index("With data-parallel attention (`--enable-dp-attention --dp-size 8`")
    rows = [line.split("|")[1:-1] for line in text[start:].splitlines()
            if line.startswith(("| DeepSeek-V3.2 | H200", "| GLM-5 | H200"))][:4]
    assert len(rows) == 4
    gib = 1 << 30
    for model, gpu, context, weights, budget, dense, hisparse, best in ([c.strip() for c in row] for row in rows):
        fields = dict(device="cuda", kv_cache_dtype="fp8_e4m3", tp_size=8, ep_size=8, enable_dp_attention=True,
                      dp_size=8, max_running_requests=512, context_length=int(context.removesuffix("K")) * 1024)
        name = {"DeepSeek-V3.2": "deepseek-v3.2", "GLM-5": "glm-5"}[model]
        plan = make_plan(read_config_json(name)[0], EngineConfig(**fields), model_name=name,
                         device_memory=GPU_MEMORY[gpu.lower()])
        h, node = plan.hisparse, plan.node_max_requests["dp_attention"]
        assert weights == f"{plan.weights_bytes_per_gpu / gib:.1f}" and budget == f"{plan.kv_budget_bytes_per_gpu / gib:.1f}"
        assert dense == f"{plan.max_requests['dense']} / {node['dense']}"
        assert hisparse.startswith(f"{h.max_requests} / {node['hisparse']} ({h.host_kv_budget_bytes / gib:.0f} GiB;")
        assert best == f"{h.best_max_requests} ({h.best_host_kv_budget_bytes / gib:.0f} GiB)"
        assert not plan.warnings
