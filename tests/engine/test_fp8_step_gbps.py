"""benchmarks/fp8_step_gbps.py (issue 21's step-level read rate): the FP8 bytes a batch-1 step reads, counted from
the config, equal the built model's FP8 projections (each read once, routed experts `num_experts_per_tok` of them)
plus the absorbed W_UK / W_UV; the report sums a family's kernels over every launch form; a step JSON whose FP8 run
failed is refused with its error, not a traceback."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch

from decode_server.model import build_random_model, load_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "fp8_step_gbps.py"
_spec = importlib.util.spec_from_file_location("fp8_step_gbps", SCRIPT)
gbps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gbps)


def test_batch1_bytes_are_the_models_fp8_projections() -> None:
    """tiny-dsa with FP8 weights: every FP8 weight and its scales once, the routed experts top-k of E, and the
    absorbed products as the 128-block FP8 per-head matrices (the same bytes as kv_b_proj)."""
    config = load_config("tiny-dsa")
    model = build_random_model(config, "cpu", torch.float32, quantization="fp8")
    raw = json.loads((ROOT / "configs" / "tiny-dsa.json").read_text())
    counted = gbps.batch1_bytes(raw)
    routed = dense = absorbed = 0
    top_k, experts = raw["num_experts_per_tok"], raw["n_routed_experts"]
    for name, module in model.named_modules():
        weight, scale = getattr(module, "weight", None), getattr(module, "fp8_scale", None)
        if scale is None or weight is None or weight.dtype != torch.float8_e4m3fn:
            continue
        nbytes = weight.numel() + 4 * scale.numel()
        if ".experts." in name:
            routed += nbytes * top_k / experts
        elif name.endswith("kv_b_proj"):
            absorbed += nbytes
        else:
            dense += nbytes
    assert counted["dense"] == dense
    assert counted["grouped (routed experts)"] == routed
    assert counted["batched (absorbed W_UK, W_UV)"] == absorbed


def _step(tmp_path: Path, fp8_run: dict) -> Path:
    path = tmp_path / "step.json"
    path.write_text(json.dumps({"meta": {"hbm_copy_gbps": 4000.0, "device": "test GPU"},
                                "rows": [{"batch": 1, "fp8_run": fp8_run}]}))
    return path


def test_report_sums_each_familys_launch_forms(tmp_path: Path) -> None:
    kernels = [["_fp8_gemv_kernel", 100.0, 10], ["_fp8_gemm_kernel", 50.0, 2], ["_fp8_grouped_gemv_rows_kernel", 40.0, 4],
               ["_fp8_bmm_kernel", 10.0, 2], ["_fp8_bmm_gemv_kernel", 10.0, 2], ["_quantize_kernel", 20.0, 8],
               ["_rms_norm_kernel", 99.0, 9]]
    path = _step(tmp_path, {"step_ms": 1.0, "top_kernels": kernels})
    out = subprocess.run([sys.executable, str(SCRIPT), str(path), str(ROOT / "configs" / "tiny-dsa.json")],
                         capture_output=True, text=True, check=True).stdout
    assert "150.0 µs   12 calls" in out  # dense: the one-row and the tensor-core kernels
    assert "40.0 µs    4 calls" in out
    assert "20.0 µs    4 calls" in out  # batched: both forms
    assert "210.0 µs" in out and "230.0 µs" in out  # all GEMM kernels, then with the quantizations


def test_a_failed_fp8_run_is_refused_with_its_error(tmp_path: Path) -> None:
    path = _step(tmp_path, {"weights": "fp8", "batch": 1, "error": "RuntimeError: out of memory"})
    done = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True)
    assert done.returncode != 0
    assert "no profile (RuntimeError: out of memory)" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_fused_shared_expert_counts_as_grouped_and_split_k_sums_join_the_quantizations(tmp_path: Path) -> None:
    raw = json.loads((ROOT / "configs" / "tiny-dsa.json").read_text())
    plain, fused = gbps.batch1_bytes(raw), gbps.batch1_bytes(raw, shared_fused_layers=99)
    moe_layers = raw["num_hidden_layers"] - raw["first_k_dense_replace"]
    inter, hidden = raw["moe_intermediate_size"], raw["hidden_size"]
    shared = gbps.fp8_bytes(2 * inter, hidden) + gbps.fp8_bytes(hidden, inter)
    assert fused["dense"] == plain["dense"] - moe_layers * shared  # capped at the MoE layers
    assert fused["grouped (routed experts)"] == plain["grouped (routed experts)"] + moe_layers * shared
    assert sum(fused.values()) == sum(plain.values())
    kernels = [["_fp8_gemv_kernel", 100.0, 10], ["_fp8_grouped_gemm_kernel", 40.0, 4], ["_splitk_sum_kernel", 5.0, 4], ["_fp8_bmm_kernel", 10.0, 2],
               ["_quantize_kernel", 20.0, 8]]
    path = tmp_path / "step.json"
    path.write_text(json.dumps({"meta": {"hbm_copy_gbps": 4000.0, "device": "test GPU", "shared_experts_fused": 1},
                                "rows": [{"batch": 1, "fp8_run": {"step_ms": 1.0, "top_kernels": kernels}}]}))
    out = subprocess.run([sys.executable, str(SCRIPT), str(path), str(ROOT / "configs" / "tiny-dsa.json")],
                         capture_output=True, text=True, check=True).stdout
    assert "the shared expert fused in 1 MoE layers" in out
    assert "150.0 µs" in out and "175.0 µs" in out  # the GEMMs, then with the quantizations and the split-K sums
