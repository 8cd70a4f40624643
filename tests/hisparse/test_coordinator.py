"""Coordinator bookkeeping without the model: budgets, slot placement, preload, retract/resume, free."""

from __future__ import annotations

import pytest
import torch

from decode_server.hisparse.coordinator import HiSparseCoordinator, HiSparseLayout


def make(num_buffers: int = 2, host_pages: int = 8, indexer_pages: int = 4, D: int = 8, R: int = 2):
    layout = HiSparseLayout(num_layers=2, top_k=4, buffer_size=D, num_recent=R, num_buffers=num_buffers,
                            host_pages=host_pages, indexer_pages=indexer_pages, page_size=4, row_bytes=8,
                            max_reqs=4, max_ctx=64)
    return HiSparseCoordinator(layout, torch.float32, torch.device("cpu"))


def test_layout_rejects_buffer_smaller_than_top_k():
    with pytest.raises(ValueError, match="device_buffer_size"):
        HiSparseLayout(num_layers=1, top_k=8, buffer_size=4, num_recent=1, num_buffers=1, host_pages=1,
                       indexer_pages=1, page_size=4, row_bytes=8, max_reqs=1, max_ctx=8)


def test_capacity_error_names_the_binding_pool():
    co = make(host_pages=4, indexer_pages=8)
    assert co.capacity_error(4, 16) is None
    assert "host KV pages" in co.capacity_error(4, 17)
    co = make(host_pages=8, indexer_pages=2)
    assert "indexer-key pages" in co.capacity_error(4, 9)
    assert "context length" in co.capacity_error(4, 65)


def test_admission_takes_all_three_budgets_and_free_returns_them():
    co = make(num_buffers=1)
    assert co.try_admit(0, prompt_len=5, max_total_len=12)
    usage = co.usage()
    assert usage["host_pages"].used == 2  # prompt + 1 token, in pages of 4 (grows with the sequence)
    assert usage["indexer_slots"].used == 8  # prompt + 1 token, in pages of 4
    assert usage["device_slots"].used == 10
    assert not co.try_admit(1, prompt_len=2, max_total_len=4), "no second device buffer"
    co.free(0)
    assert co.is_empty()


def test_new_token_slots_identity_then_ring():
    co = make(D=8, R=2)
    co.try_admit(0, 3, 20)
    base = int(co.buffers.buffer_slots[0, 0])
    assert [co.buffers.slot_of_new_token(0, p) - base for p in range(8)] == list(range(8))
    assert [co.buffers.slot_of_new_token(0, p) - base for p in (8, 9, 10, 11)] == [8, 9, 8, 9]


def test_preload_fills_identity_and_ring_from_host():
    co = make(D=8, R=2, host_pages=8, indexer_pages=8)
    co.try_admit(0, 11, 20)
    rows = co.host.rows.slots(0, 11).long()
    # Host row of token t holds byte value t + 1 in layer 0 and t + 101 in layer 1.
    for t in range(11):
        co.host.kv[0, rows[t]] = t + 1
        co.host.kv[1, rows[t]] = t + 101
    co.finish_prefill(0, 11)
    slots = co.buffers.buffer_slots[0].long()
    for t in range(8):
        assert int(co.buffers.kv[0, slots[t], 0]) == t + 1
    # Next step has seq_len 12: the ring holds tokens >= max(D, 12 - R) = 10, i.e. token 10 at D + 10 % 2.
    assert int(co.buffers.kv[1, slots[8 + 10 % 2], 0]) == 10 + 101
    assert torch.equal(co.buffers.buffer_tokens[:, 0], torch.arange(8, dtype=torch.int32).repeat(2, 1))


def test_admission_and_growth_take_pages_as_the_sequence_grows():
    co = make(num_buffers=2, host_pages=3, indexer_pages=8)
    assert co.max_request_tokens == 12
    assert co.try_admit(0, prompt_len=3, max_total_len=60)
    assert co.usage()["host_pages"].used == 1 and co.free_pages() == 2
    assert co.pages_needed(0, 9) == 2
    assert co.ensure_room(0, 9)
    assert co.usage()["host_pages"].used == 3 and co.usage()["indexer_slots"].used == 12
    assert not co.ensure_room(0, 13), "the host pool is full"
    assert co.usage()["indexer_slots"].used == 12, "a refused growth takes nothing"
    co.free(0)
    assert co.is_empty()


def test_retract_moves_kv_out_of_the_pools_and_resume_restores_it():
    co = make(num_buffers=1, indexer_pages=4)
    co.try_admit(0, 6, 12)
    idx_rows = co.indexer.rows.slots(0, 6).long()
    co.indexer.scales[:, idx_rows] = torch.arange(6, dtype=torch.float32) + 1
    host_rows = co.host.rows.slots(0, 6).long()
    co.host.kv[:, host_rows] = (torch.arange(6, dtype=torch.uint8) + 7).view(1, 6, 1)
    co.retract(0, 6)
    u = co.usage()
    assert u["device_slots"].used == 0 and u["indexer_slots"].used == 0 and u["host_pages"].used == 0
    assert not co.is_empty()  # the request's KV is held outside the pools
    assert co.try_admit(1, 2, 4)  # the freed buffer is reusable
    assert not co.try_resume(0, 6)
    co.free(1)
    assert co.try_resume(0, 6)
    idx_rows = co.indexer.rows.slots(0, 6).long()
    assert torch.equal(co.indexer.scales[0, idx_rows], torch.arange(6, dtype=torch.float32) + 1)
    host_rows = co.host.rows.slots(0, 6).long()
    assert torch.equal(co.host.kv[1, host_rows, 3], torch.arange(6, dtype=torch.uint8) + 7)
    co.free(0)
    assert co.is_empty()


def test_free_while_retracted_releases_everything():
    co = make()
    co.try_admit(0, 6, 12)
    co.retract(0, 6)
    assert not co.is_empty()  # host rows and indexer keys are held outside the pools
    co.free(0)
    assert co.is_empty()
