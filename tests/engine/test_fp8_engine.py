"""`--quantization` through the CLI and the engine on CPU: the flag maps onto EngineConfig, the CPU engine
dequantizes whatever is asked (the GPU keeps FP8: tests/engine/test_fp8_weight_bytes_gpu.py), the engine reports what
its weights hold (EngineStats, /server_info's stats and /metrics), and an engine given an FP8-storage model runs
it (PyTorch reference GEMMs on CPU) with HiSparse equal to dense."""

from __future__ import annotations

import logging

import pytest
import torch

from decode_server.api.metrics import ServerMetrics
from decode_server.cli import build_parser, engine_config_from_args
from decode_server.config import EngineConfig, HiSparseConfig
from decode_server.engine.engine import Engine, resolve_quantization
from decode_server.engine.sampling_params import SamplingParams
from decode_server.engine.types import EngineStats
from decode_server.model import load_model
from decode_server.model.weights import weight_bytes


def test_cli_flag_maps_onto_the_engine_config(capsys) -> None:
    parser = build_parser()
    assert engine_config_from_args(parser.parse_args(["serve"])).quantization is None
    for value in ("auto", "fp8", "none"):
        assert engine_config_from_args(parser.parse_args(["serve", "--quantization", value])).quantization == value
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["serve", "--quantization", "int8"])
    assert exc.value.code == 2
    assert "--quantization" in capsys.readouterr().err
    help_text = parser._subparsers._group_actions[0].choices["serve"].format_help()
    assert "--quantization {auto,fp8,none}" in help_text


def test_quantization_resolution(caplog) -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_quantization(None, cuda) == "auto"
    assert resolve_quantization("fp8", cuda) == "fp8"
    assert resolve_quantization("none", cuda) == "none"
    assert resolve_quantization(None, cpu) == "none"
    with caplog.at_level(logging.WARNING):
        assert resolve_quantization("fp8", cpu) == "none"
    assert "dequantized" in caplog.text


def test_cpu_engine_dequantizes_and_reports_its_weight_bytes() -> None:
    engine = Engine(EngineConfig(device="cpu", quantization="fp8", device_kv_budget_bytes=16 << 20,
                                 chunked_prefill_size=128, page_size=16))
    stats = engine.stats()
    assert stats.quantization == "none" and engine.quantization == "none"
    assert all(p.dtype != torch.float8_e4m3fn for p in engine.model.parameters())
    expected = weight_bytes(engine.model)
    assert stats.weights_bytes == expected["total"] > 0
    assert stats.weights_bytes_by_kind == {k: v for k, v in expected.items() if k != "total"}
    assert stats.weights_bytes_by_kind["fp8"] == 0 and stats.weights_bytes_by_kind["absorbed"] > 0
    # Carried through the api process as JSON (/server_info's "stats").
    assert EngineStats.model_validate_json(stats.model_dump_json()) == stats


def test_metrics_show_the_weight_bytes() -> None:
    metrics = ServerMetrics("tiny-dsa")
    metrics.latest_stats = EngineStats(weights_bytes=12345, weights_bytes_by_kind={"fp8": 10000, "other": 2345})
    text = metrics.render().decode()
    assert 'hisparse:weights_bytes{model_name="tiny-dsa"} 12345.0' in text
    assert 'hisparse:weights_bytes_by_kind{kind="fp8",model_name="tiny-dsa"} 10000.0' in text


def test_engine_runs_an_fp8_model_and_hisparse_equals_dense() -> None:
    """An FP8-storage model (kept FP8 on CPU by asking the loader explicitly): the engine serves it, its stats
    say FP8, and HiSparse gives dense's tokens."""
    model, config = load_model("tiny-dsa", "cpu", torch.float32, quantization="fp8")
    outputs = []
    for hisparse in (False, True):
        engine = Engine(EngineConfig(device="cpu", enable_hisparse=hisparse, page_size=16, chunked_prefill_size=64,
                                     device_kv_budget_bytes=16 << 20, host_kv_budget_bytes=32 << 20,
                                     hisparse=HiSparseConfig(device_buffer_size=64, num_recent_slots=2)),
                        model=model, model_config=config, tokenizer=None)
        stats = engine.stats()
        assert stats.quantization == "fp8" and stats.weights_bytes_by_kind["fp8"] > 0
        prompt = torch.randint(2, 1000, (90,), generator=torch.Generator().manual_seed(2)).tolist()
        engine.add_request("r", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens += delta.new_token_ids
        outputs.append(tokens)
        assert engine.is_idle_and_empty()
    assert len(outputs[0]) == 6 and outputs[0] == outputs[1]
