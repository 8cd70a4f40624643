"""Pool sizing from EngineConfig budgets."""

from __future__ import annotations

import pytest
import torch

from decode_server.config import EngineConfig, HiSparseConfig
from decode_server.engine import memory
from decode_server.hisparse.indexer_pool import INDEX_KEY_BYTES

CPU = torch.device("cpu")
ROW = 576 * 2  # bf16


def test_dense_slots_fill_the_budget_in_whole_pages():
    cfg = EngineConfig(device="cpu", device_kv_budget_bytes=10 << 20, page_size=64)
    slots = memory.plan_dense_slots(cfg, CPU, num_layers=4, kv_dtype=torch.bfloat16)
    per_token = 4 * (ROW + INDEX_KEY_BYTES)
    assert slots % 64 == 0 and slots * per_token <= 10 << 20 < (slots + 64) * per_token


@pytest.mark.parametrize("host", [None, 2 << 20, 512 << 20])
def test_hisparse_layout_stays_within_both_budgets(host):
    device_budget = 32 << 20
    cfg = EngineConfig(device="cpu", enable_hisparse=True, device_kv_budget_bytes=device_budget,
                       host_kv_budget_bytes=host, page_size=16, max_running_requests=16,
                       hisparse=HiSparseConfig(device_buffer_size=256, num_recent_slots=4))
    lay = memory.plan_hisparse(cfg, CPU, num_layers=4, index_topk=128, kv_dtype=torch.bfloat16, max_ctx=8192)
    assert lay.buffer_size == 256 and lay.top_k == 128 and lay.num_recent == 4
    assert 1 <= lay.num_buffers <= 16 and lay.indexer_pages >= 1
    device_used = lay.num_buffers * lay.buffer_bytes + lay.indexer_pages * 16 * lay.indexer_bytes_per_token
    assert device_used <= device_budget
    host_budget = host if host is not None else 4 * device_budget
    assert lay.host_pages * 16 * ROW * 4 <= host_budget
    assert lay.indexer_pages <= lay.host_pages


def test_hisparse_defaults_and_errors():
    cfg = EngineConfig(device="cpu", enable_hisparse=True, device_kv_budget_bytes=64 << 20)
    lay = memory.plan_hisparse(cfg, CPU, num_layers=2, index_topk=64, kv_dtype=torch.float32, max_ctx=1024)
    assert lay.buffer_size == 128  # 2 * top_k
    tiny = EngineConfig(device="cpu", enable_hisparse=True, device_kv_budget_bytes=1000, host_kv_budget_bytes=1 << 30)
    with pytest.raises(ValueError, match="cannot hold one request buffer"):
        memory.plan_hisparse(tiny, CPU, num_layers=2, index_topk=64, kv_dtype=torch.float32, max_ctx=1024)
    small = EngineConfig(device="cpu", enable_hisparse=True,
                         hisparse=HiSparseConfig(device_buffer_size=32))
    with pytest.raises(ValueError, match="must be >= top_k"):
        memory.plan_hisparse(small, CPU, num_layers=2, index_topk=64, kv_dtype=torch.float32, max_ctx=1024)


def test_derived_host_budget_is_capped_by_available_memory(monkeypatch):
    monkeypatch.setattr(memory, "available_host_memory", lambda: 10 << 30)
    cfg = EngineConfig(enable_hisparse=True)
    assert memory.host_kv_budget(cfg, 100 << 30) == 5 << 30
    # Data-parallel attention: 4 ranks each pin their own pool, so each gets a quarter of the capped share.
    assert memory.host_kv_budget(cfg, 100 << 30, num_pools=4) == (5 << 30) // 4
    assert memory.host_kv_budget(cfg, 256 << 20, num_pools=4) == 1 << 30  # under the cap: the ratio decides
    assert memory.host_kv_budget(cfg.model_copy(update={"host_kv_budget_bytes": 7 << 30}), 100 << 30) == 7 << 30


def test_fp8_kv_rows_are_656_bytes_and_fit_more_tokens():
    """fp8_e4m3 resolves to FlashMLA's 656 B row; every budget counts 656 B per row per layer."""
    fp8 = memory.resolve_kv_dtype(EngineConfig(kv_cache_dtype="fp8_e4m3"), torch.bfloat16)
    assert memory.row_bytes_of(fp8) == 656 and memory.row_bytes_of(torch.bfloat16) == ROW
    cfg = EngineConfig(device="cpu", device_kv_budget_bytes=10 << 20, page_size=64)
    slots = memory.plan_dense_slots(cfg, CPU, num_layers=4, kv_dtype=fp8)
    per_token = 4 * (656 + INDEX_KEY_BYTES)
    assert slots % 64 == 0 and slots * per_token <= 10 << 20 < (slots + 64) * per_token
    assert slots > memory.plan_dense_slots(cfg, CPU, num_layers=4, kv_dtype=torch.bfloat16)
    hs = EngineConfig(device="cpu", enable_hisparse=True, device_kv_budget_bytes=32 << 20, page_size=16,
                      host_kv_budget_bytes=64 << 20, max_running_requests=64,
                      hisparse=HiSparseConfig(device_buffer_size=256, num_recent_slots=4))
    lay8 = memory.plan_hisparse(hs, CPU, num_layers=4, index_topk=128, kv_dtype=fp8, max_ctx=8192)
    lay16 = memory.plan_hisparse(hs, CPU, num_layers=4, index_topk=128, kv_dtype=torch.bfloat16, max_ctx=8192)
    assert lay8.row_bytes == 656 and lay8.buffer_bytes == (256 + 4) * 656 * 4
    assert lay8.host_pages == (64 << 20) // (656 * 4 * 16) > lay16.host_pages
    assert lay8.num_buffers > lay16.num_buffers
    assert lay8.num_buffers * lay8.buffer_bytes + lay8.indexer_pages * 16 * lay8.indexer_bytes_per_token <= 32 << 20
