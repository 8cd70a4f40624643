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

    def no_timing(fn, calls):
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
