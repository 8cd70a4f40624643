"""The indexer's per-request token rows ([B, width]) are gathered once a forward, in the backend's begin_forward,
and every layer's indexer reads that one tensor — dense and HiSparse, prefill, plain decode and the padded static
decode batches that CUDA graphs capture (run eagerly here): each indexer call gets the same tensor as the other
layers of its forward, equal to a gather of its own and with the same selection as that gather gives; nothing
holds it after the forward; HiSparse == dense bit for bit."""

from __future__ import annotations

import torch
from harness import assert_identical, make_engine, run_script
from test_cuda_graph_padding import BUCKETS, SMALL, workload

from decode_server.engine import dense_backend
from decode_server.engine.forward_context import get_forward_context


def _indexer_table(engine) -> torch.Tensor:
    """The table the backend's indexer rows come from: dense token slots, or HiSparse indexer-key rows."""
    backend = engine.kv.backend
    return backend.cache.tokens.table if hasattr(backend, "cache") else backend.co.indexer.rows.table


def test_every_layer_reads_the_forwards_one_token_rows(tiny_cpu, monkeypatch) -> None:
    original = dense_backend.indexer_topk  # HiSparse's ops.indexer_topk calls it too
    engine_of_run: list = []
    calls: list[tuple[object, torch.Tensor, bool]] = []  # (forward context, token_rows, static batch)

    def recording(q, weights, keys, scales, token_rows, token_req, seq_lens, top_k, reference=False,
                  tables_ready=False):
        assert tables_ready  # made in begin_forward: the scores kernel may read them before the write ends
        got = original(q, weights, keys, scales, token_rows, token_req, seq_lens, top_k, reference, tables_ready)
        ctx = get_forward_context()
        batch = ctx.batch
        own = _indexer_table(engine_of_run[-1]).clone()[batch.req_rows, : batch.token_table_width()]
        assert torch.equal(token_rows, own)
        assert torch.equal(got, original(q, weights, keys, scales, own, token_req, seq_lens, top_k, reference))
        calls.append((ctx, token_rows, batch.static))
        return got

    monkeypatch.setattr(dense_backend, "indexer_topk", recording)
    results = {}
    for hisparse in (False, True):
        calls.clear()
        engine = make_engine(tiny_cpu, hisparse=hisparse, eager_graph_buckets=BUCKETS, **SMALL)
        engine_of_run.append(engine)
        results[hisparse] = run_script(engine, workload())
        layers = engine.model_config.num_hidden_layers
        forwards: dict[int, list[torch.Tensor]] = {}
        for ctx, rows, _ in calls:
            forwards.setdefault(id(ctx), []).append(rows)  # the contexts stay alive in `calls`: ids are unique
        assert all(len(rows) == layers and all(r is rows[0] for r in rows) for rows in forwards.values())
        assert any(static for _, _, static in calls) and not all(static for _, _, static in calls)
        assert engine.kv.backend._token_rows is None
    assert_identical(results[False], results[True])
