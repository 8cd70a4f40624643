"""The newest tokens stay on the device: in every decode step, each selected position in the recent window maps
to its ring slot (never a miss), and the previous token's ring slot holds exactly the row the backup copied to
its host row."""

from __future__ import annotations

import torch
from harness import Arrival, make_engine, random_prompt, run_script

from decode_server.hisparse import ops


def test_recent_tokens_are_ring_hits_with_the_right_rows(tiny_cpu, monkeypatch):
    checked = {"recent": 0, "previous": 0}
    original = ops.bind_swap_in

    def binding(tables):
        swap = original(tables)
        buffer_slots, host_rows, host_pool, device_pool = (tables.buffer_slots, tables.host_rows, tables.host_pool,
                                                           tables.device_pool)  # fmt: skip
        D, R = tables.buffer_tokens.shape[1], tables.num_recent

        def checking(top_k, seq_lens, req_rows):
            out = swap(top_k, seq_lens, req_rows)
            for b in range(top_k.shape[0]):
                s, r = int(seq_lens[b]), int(req_rows[b])
                if s <= D:
                    continue
                for t in range(max(D, s - R), s):
                    ring_slot = int(buffer_slots[r, D + t % R])
                    hit = (top_k[b] == t).nonzero()
                    if hit.numel():
                        assert int(out[b, hit[0, 0]]) == ring_slot
                        checked["recent"] += 1
                    if t == s - 2:  # backed up after the previous step
                        assert torch.equal(device_pool[ring_slot], host_pool[int(host_rows[r, t])])
                        checked["previous"] += 1
            return out

        return checking

    monkeypatch.setattr(ops, "bind_swap_in", binding)  # the backend binds one swap-in per layer at construction
    engine = make_engine(tiny_cpu, hisparse=True, num_recent=3)
    gen = torch.Generator().manual_seed(5)
    # One prompt longer than D, one crossing D during decode.
    run_script(engine, [Arrival(0, "long", random_prompt(gen, 70), 8), Arrival(0, "cross", random_prompt(gen, 60), 10)])
    assert checked["recent"] > 0 and checked["previous"] > 0
    assert engine.is_idle_and_empty()
