"""The FP8 GEMM tables (kernels/fp8_gemm_table.py) and the tuner's "table" mode, on CPU: a process decides from the
table of its GPU model without timing anything, so two processes make the same choices (replicas, a server with and
without CUDA graphs); shapes the table lacks take the default Triton configuration; a forced backend is honoured;
a malformed table is an error, not an empty table. Timing and the device name are stubbed."""

from __future__ import annotations

import json

import pytest
import torch

from kernels import fp8_gemm, fp8_gemm_table

pytest.importorskip("triton")

CUDA0 = torch.device("cuda", 0)
BLOCK = (128, 128)


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A GPU named 'Fake GPU 80GB' whose table is a file in tmp_path; timing any candidate fails the test."""
    monkeypatch.setattr(fp8_gemm, "_sm_count", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake GPU 80GB")

    def no_timing(fns, calls):
        raise AssertionError("table mode must not time anything")

    monkeypatch.setattr(fp8_gemm, "_time_us", no_timing)
    path = tmp_path / "tables" / "fake_gpu_80gb.json"
    monkeypatch.setattr(fp8_gemm_table, "TABLE_DIR", path.parent)
    monkeypatch.delenv(fp8_gemm_table.TABLE_ENV, raising=False)
    fp8_gemm_table._device_table.cache_clear()
    yield path
    fp8_gemm_table._device_table.cache_clear()


def entry(kind: str, n: int, k: int, bucket: int, backend: str, config=None, experts: int = 0) -> dict:
    return {"kind": kind, "n": n, "k": k, "experts": experts, "bucket": bucket, "dtype": "bfloat16",
            "backend": backend, "config": config, "us": {}}


def choose(tuner: fp8_gemm.Fp8GemmTuner, n: int, k: int, m: int, kind: str = "dense", experts: int = 0):
    shape = (experts, n, k) if kind == "grouped" else (n, k)
    w = torch.zeros(shape, dtype=torch.float8_e4m3fn)
    return tuner.choose(kind, n, k, experts, m, torch.bfloat16, CUDA0, [(w, torch.ones(1))], BLOCK)


def test_slug_and_path(monkeypatch, tmp_path) -> None:
    assert fp8_gemm_table.device_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    assert fp8_gemm_table.table_path("NVIDIA H200").name == "nvidia_h200.json"
    monkeypatch.setenv(fp8_gemm_table.TABLE_ENV, str(tmp_path / "mine.json"))
    assert fp8_gemm_table.table_path("NVIDIA H200") == tmp_path / "mine.json"


def test_table_choices_are_used_untimed_and_the_same_in_every_tuner(fake_gpu, monkeypatch) -> None:
    monkeypatch.setattr(fp8_gemm, "scaled_mm_supported", lambda n, k, block, device: True)
    tuned = {"block_m": 16, "block_n": 128, "split_k": 4, "num_warps": 4, "num_stages": 4, "m_programs": 1}
    fp8_gemm_table.write_table(fake_gpu, "Fake GPU 80GB", [
        entry("dense", 576, 7168, 1, "triton", tuned),
        entry("dense", 24576, 1536, 1, "scaled_mm"),
    ], {"measured": "test"})
    first, second = fp8_gemm.Fp8GemmTuner("table"), fp8_gemm.Fp8GemmTuner("table")
    picked = choose(first, 576, 7168, 1)
    assert picked.backend == "triton" and picked.config.split_k == 4 and picked.config.block_n == 128
    assert choose(second, 576, 7168, 1) == picked  # another process: the same decision
    assert choose(first, 24576, 1536, 1).backend == "scaled_mm"
    missing = choose(first, 576, 7168, 64)  # bucket 64 is not in the table
    assert missing == fp8_gemm.default_choice("dense", 64, 576, 7168, 0, CUDA0)
    assert all(r.timings_us == {} for r in first.records)
    with fp8_gemm.force_backend("triton"):  # the table's scaled_mm is not allowed: the default instead
        assert choose(fp8_gemm.Fp8GemmTuner("table"), 24576, 1536, 1).backend == "triton"
    with fp8_gemm.force_backend("scaled_mm"):
        assert choose(fp8_gemm.Fp8GemmTuner("table"), 576, 7168, 1).backend == "scaled_mm"


def test_without_a_table_every_shape_takes_the_default(fake_gpu) -> None:
    tuner = fp8_gemm.Fp8GemmTuner("table")
    assert choose(tuner, 2048, 7168, 8, kind="grouped", experts=32) == fp8_gemm.default_choice(
        "grouped", 8, 2048, 7168, 32, CUDA0)


def test_untabled_dense_keys_at_prefill_sizes_take_scaled_mm_by_rule(fake_gpu, monkeypatch, caplog) -> None:
    """A dense key the table lacks at a prefill-sized M bucket runs cuBLAS's block-FP8 GEMM (about twice the
    default Triton configuration's speed there on an H200), untimed and the same in every process; decode sizes,
    grouped keys, a forced Triton backend and shapes scaled_mm cannot run keep the default, and only those count
    as untabled in the warm-up's warning."""
    from decode_server.model.fp8_warmup import warn_untabled

    supported = {"yes": True}
    monkeypatch.setattr(fp8_gemm, "scaled_mm_supported", lambda n, k, block, device: supported["yes"])
    tuned = {"block_m": 64, "block_n": 128, "split_k": 1, "num_warps": 4, "num_stages": 4, "m_programs": 1}
    fp8_gemm_table.write_table(fake_gpu, "Fake GPU 80GB", [entry("dense", 576, 7168, 1024, "triton", tuned)],
                               {"measured": "test"})
    first, second = fp8_gemm.Fp8GemmTuner("table"), fp8_gemm.Fp8GemmTuner("table")
    prefill = fp8_gemm.UNTABLED_SCALED_MM_MIN_BUCKET
    assert choose(first, 2112, 7168, prefill) == choose(second, 2112, 7168, prefill) == fp8_gemm.GemmChoice(
        "scaled_mm")
    assert choose(first, 2112, 7168, 8192).backend == "scaled_mm"
    assert choose(first, 576, 7168, 1000).config.block_m == 64  # the table's own entry still wins
    decode = prefill // 2
    assert choose(first, 2112, 7168, decode) == fp8_gemm.default_choice("dense", decode, 2112, 7168, 0, CUDA0)
    assert choose(first, 2048, 7168, 4096, kind="grouped", experts=32).backend == "triton"
    with fp8_gemm.force_backend("triton"):
        assert choose(fp8_gemm.Fp8GemmTuner("table"), 2112, 7168, 4096).backend == "triton"
    supported["yes"] = False
    assert choose(fp8_gemm.Fp8GemmTuner("table"), 2112, 7168, 4096).backend == "triton"
    sources = [r.source for r in first.records]
    assert sources.count(fp8_gemm.UNTABLED_SCALED_MM) == 2 and sources.count("table") == 1
    assert sources.count(fp8_gemm.NO_TABLE_ENTRY) == 2  # the decode-sized dense key and the grouped one
    with caplog.at_level("WARNING", logger="decode_server.model.fp8_warmup"):
        assert warn_untabled(first.records) == 2


def test_write_merges_and_a_malformed_table_is_an_error(fake_gpu, monkeypatch) -> None:
    fp8_gemm_table.write_table(fake_gpu, "Fake GPU 80GB", [entry("dense", 576, 7168, 1, "scaled_mm")],
                               {"command": "tune --configs a"})
    total = fp8_gemm_table.write_table(fake_gpu, "Fake GPU 80GB", [entry("dense", 576, 7168, 1, "triton", None),
                                                                  entry("dense", 576, 7168, 2, "scaled_mm")],
                                       {"command": "tune --configs b"})
    table = fp8_gemm_table.read_table(fake_gpu)
    assert total == 2 and table[("dense", 576, 7168, 0, 1, "bfloat16")] == ("triton", None)
    # A merged table names every run that wrote it.
    assert json.loads(fake_gpu.read_text())["command"] == "tune --configs a && tune --configs b"
    fake_gpu.write_text(json.dumps({"device": "x", "entries": [{"kind": "dense"}]}))
    with pytest.raises(ValueError, match="malformed"):
        fp8_gemm_table.read_table(fake_gpu)


def test_mode_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(fp8_gemm.TUNING_ENV, "measure")
    assert fp8_gemm.Fp8GemmTuner().mode == "measure"
    monkeypatch.delenv(fp8_gemm.TUNING_ENV)
    assert fp8_gemm.Fp8GemmTuner().mode == "table"
    monkeypatch.setenv(fp8_gemm.TUNING_ENV, "fastest")
    with pytest.raises(ValueError, match="HISPARSE_FP8_GEMM_TUNING"):
        fp8_gemm.Fp8GemmTuner()


# The layouts the shipped tables are tuned for (benchmarks/tune_fp8_gemm.py --max-tokens 256; the commands are in
# each table's "command"): real models at TP1 and TP8/EP8, the one-rank configs, the FP8 bench configs.
TUNED_LAYOUTS = [("deepseek-v3.2", 1, 1), ("deepseek-v3.2", 8, 8), ("dsv32-rank-ep8", 1, 1),
                 ("dsv32-rank-ep16", 1, 1), ("dsv32-bench-16l", 1, 1), ("glm-5", 1, 1), ("glm-5", 8, 8),
                 ("glm5-rank-ep8", 1, 1), ("glm5-bench", 1, 1)]
DECODE_TOKEN_COUNTS = [1 << i for i in range(9)]  # 1 … 256
# Shapes a table is known to lack at decode sizes, by table: (kind, N, K). The H100's: GLM-5's shared layers' kv_a
# (N 576, K 6144), which runs alone there because the H100 never measured those layers' stacked q_a + kv_a (N 2624;
# the tuning model holds a shared layer since 2026-11-29, when the H200 measured it; no H100 lent since). Tuning
# it: benchmarks/results/h100_prefill_table_prep_2026-11-29/call.sh. Each gap must still be missing (else drop it).
DECODE_KNOWN_GAPS = {"nvidia_h100_80gb_hbm3": {("dense", 576, 6144)}}


@pytest.mark.parametrize(("config_name", "tp", "ep"), TUNED_LAYOUTS)
def test_shipped_tables_cover_every_shape_of_the_tuned_layouts(config_name: str, tp: int, ep: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Every FP8 GEMM decision the engine's warm-up makes for decode batches up to 256 is in every shipped GPU
    table. A missing key silently runs the untimed default configuration: GLM-5's shapes did until 2026-11-27
    (its FP8 step at batch 1 was 1.13× the bf16 step on the H200, 0.84× once tuned), as did DeepSeek-V3.2's TP8
    stacked projections and the 16 local experts of `dsv32-rank-ep16`."""
    tables = sorted(fp8_gemm_table.TABLE_DIR.glob("*.json"))
    assert {path.stem for path in tables} >= {"nvidia_h100_80gb_hbm3", "nvidia_h200"}
    for path in tables:
        _assert_table_covers(path, config_name, tp, ep, DECODE_TOKEN_COUNTS, monkeypatch, min_keys=50,
                             gaps=DECODE_KNOWN_GAPS.get(path.stem, set()))


# Prefill chunks' token counts (512 … 4096: a 2048-token chunk alone, or with the decode rows mixed into its pass,
# which the engine's warm-up counts as bucket 4096), tuned on the H200 on 2026-11-29 (tune_fp8_gemm.py
# --min-tokens 512 --max-tokens 2048, then 4096 alone) for the layouts a one-GPU rank or a TP8/EP8 rank runs.
# The H100's table holds decode sizes only (no H100 lent since): there dense prefill keys take cuBLAS by rule and
# the grouped / batched ones the untimed default.
PREFILL_TOKEN_COUNTS = [512, 1024, 2048, 4096]
# GLM-5's shared layers' q_b alone (N 16384, K 2048; full layers stack it with the indexer's wq_b) was measured at
# 512-4096 tokens on 2026-11-29 (`--shapes 16384:2048`: cuBLAS 36.5-242.8 µs, Triton's fastest 1.75-1.86x that).
PREFILL_KNOWN_GAPS: set[tuple[str, int, int]] = set()
PREFILL_TUNED_LAYOUTS = [("dsv32-rank-ep8", 1, 1), ("dsv32-rank-ep16", 1, 1), ("glm5-rank-ep8", 1, 1),
                         ("dsv32-bench", 1, 1), ("dsv32-bench-16l", 1, 1), ("glm5-bench", 1, 1),
                         ("deepseek-v3.2", 8, 8), ("glm-5", 8, 8)]


@pytest.mark.parametrize(("config_name", "tp", "ep"), PREFILL_TUNED_LAYOUTS)
def test_h200_table_covers_prefill_chunk_sizes(config_name: str, tp: int, ep: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The H200's table holds every decision at prefill chunks' sizes too: before it did, each chunk's dense GEMMs
    ran the untimed Triton default (then cuBLAS by rule) and the routed experts' grouped GEMMs the untimed default;
    measured, a dsv32-rank-ep8 FP8 prefill of 8K / 32K tokens took 0.95× the time (docs/benchmarks.md)."""
    _assert_table_covers(fp8_gemm_table.TABLE_DIR / "nvidia_h200.json", config_name, tp, ep, PREFILL_TOKEN_COUNTS,
                         monkeypatch, min_keys=10, gaps=PREFILL_KNOWN_GAPS)


def _assert_table_covers(path, config_name: str, tp: int, ep: int, token_counts: list[int],
                         monkeypatch: pytest.MonkeyPatch, min_keys: int,
                         gaps: set[tuple[str, int, int]]) -> None:
    """The model is built on the meta device: shapes only, no weights. Which GEMMs run depends on the table
    itself — the routed experts' gate and up join into one grouped GEMM only where the GPU's table has the joined
    shape (`MoE._joins_gate_up`), projections stack only where it has the stacked shape (`worth_stacking`) — so
    the model is built per table, deciding as an engine on that GPU would. `gaps`: (kind, N, K) shapes known to be
    missing, each of which must still be missing at some of these token counts."""
    import decode_server.model.fused_linear as fused_linear_module
    import decode_server.model.moe as moe_module
    from decode_server.model import load_config
    from decode_server.model.construct import build_empty_model
    from decode_server.model.fp8_warmup import table_keys, tuning_config
    from decode_server.parallel.state import ParallelState

    config = tuning_config(load_config(config_name))
    # Batched: the absorbed MLA products in FP8, where the heads are whole 128-blocks (DeepSeek-V3.2, not GLM-5).
    whole_blocks = config.qk_nope_head_dim % 128 == 0 and config.v_head_dim % 128 == 0
    entries = fp8_gemm_table.read_table(path)
    monkeypatch.setattr(moe_module, "grouped_shape_tuned", lambda n, k, experts, device: any(
        key[:4] == ("grouped", n, k, experts) for key in entries))
    monkeypatch.setattr(fused_linear_module, "dense_shape_tuned", lambda n, k, device: any(
        key[:4] == ("dense", n, k, 0) for key in entries))
    model = build_empty_model(config, torch.device("meta"), torch.bfloat16,
                              ParallelState(tp_rank=0, tp_size=tp, ep_size=ep), fp8=True)
    model.finalize_weights()
    keys = table_keys(model, token_counts, int(config.num_experts_per_tok))
    assert {key[0] for key in keys} == {"dense", "grouped"} | ({"batched"} if whole_blocks else set())
    assert len(keys) > min_keys
    missing = sorted(key for key in keys if key not in entries)
    known = [key for key in missing if key[:3] in gaps]
    unknown = [key for key in missing if key[:3] not in gaps]
    assert not unknown, f"{path.name} lacks {len(unknown)} {config_name} TP{tp} EP{ep} keys, e.g. {unknown[:3]}"
    planned_gaps = {key[:3] for key in keys} & gaps
    assert planned_gaps <= {key[:3] for key in known}, f"{path.name} now holds {planned_gaps}: drop the gap"


def test_decisions_missing_from_the_table_are_recorded_and_warned_once(fake_gpu, caplog) -> None:
    """A key the table lacks runs the default, and the warm-up says so in one warning naming the shapes (each
    decision's own line is INFO, easy to miss); keys the table holds say "table" and raise nothing."""
    from decode_server.model.fp8_warmup import warn_untabled

    tuned = {"block_m": 16, "block_n": 128, "split_k": 4, "num_warps": 4, "num_stages": 4, "m_programs": 1}
    fp8_gemm_table.write_table(fake_gpu, "Fake GPU 80GB", [entry("dense", 576, 7168, 1, "triton", tuned)],
                               {"measured": "test"})
    tuner = fp8_gemm.Fp8GemmTuner("table")
    choose(tuner, 576, 7168, 1)
    assert [r.source for r in tuner.records] == ["table"]
    with caplog.at_level("WARNING", logger="decode_server.model.fp8_warmup"):
        assert warn_untabled(tuner.records) == 0
    assert not caplog.records
    choose(tuner, 576, 7168, 64)
    choose(tuner, 2048, 6144, 8, kind="grouped", experts=32)
    assert [r.source for r in tuner.records] == ["table", fp8_gemm.NO_TABLE_ENTRY, fp8_gemm.NO_TABLE_ENTRY]
    with caplog.at_level("WARNING", logger="decode_server.model.fp8_warmup"):
        assert warn_untabled(tuner.records) == 2
        assert warn_untabled(tuner.records, max_tokens=2050) == 2  # a 2048-token chunk + 2 decode rows
    first, second = caplog.records
    assert first.levelname == "WARNING"
    assert "2 of 3 decisions" in first.getMessage() and "dense N=576 K=7168" in first.getMessage()
    assert "grouped N=2048 K=6144 E=32" in first.getMessage()
    # The tuning command it suggests reaches the warm-up's largest pass (the tuner's default stops at 512 tokens).
    assert "--max-tokens" not in first.getMessage()
    assert "--parallel <TP>x<EP> --max-tokens 4096 and ship" in second.getMessage()


@pytest.mark.parametrize(("config_name", "kinds"), [("glm5-rank-ep8", ("full", "full", "shared")),
                                                    ("dsv32-rank-ep8", ("full", "full")),
                                                    ("glm-5", ("full", "full"))])
def test_tuning_model_holds_every_kind_of_layer(config_name: str, kinds: tuple[str, ...]) -> None:
    """The tuner's cut model keeps a shared (indexer-less) layer where the model has one: its stacked input
    projection, q_a + kv_a without the indexer's wk, is a shape of its own (GLM-5: N 2624 against 2752 with wk),
    never measured until 2026-11-29. Built on the meta device with every stack allowed (as off CUDA)."""
    from decode_server.model import load_config
    from decode_server.model.construct import build_empty_model
    from decode_server.model.fp8_warmup import fp8_workloads, tuning_config

    config = tuning_config(load_config(config_name))
    assert config.indexer_types == kinds and config.num_hidden_layers == len(kinds)
    model = build_empty_model(config, torch.device("meta"), torch.bfloat16, fp8=True)
    model.finalize_weights()
    dense = {tuple(weights[0][0].shape) for kind, weights, _, _ in fp8_workloads(model) if kind == "dense"}
    inputs = config.q_lora_rank + config.kv_lora_rank + config.qk_rope_head_dim
    assert ((inputs, config.hidden_size) in dense) == ("shared" in kinds)
    assert (inputs + config.index_head_dim, config.hidden_size) in dense
