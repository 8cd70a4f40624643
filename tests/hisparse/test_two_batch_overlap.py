"""Two-batch overlap (`--enable-two-batch-overlap`, decode_server/engine/two_batch.py) on CPU, where the two
micro-batches run one after the other with the arithmetic of the GPU path:

- HiSparse == dense bit for bit with it on (tokens and logits), unpadded and with the padded static batches that
  CUDA graphs capture (run eagerly), with overlap scheduling, an abort, NaN-poisoned HiSparse pools; every pool
  empty at the end; the swap-in counters count exactly the real rows' selections (padded rows of both
  micro-batches read nothing);
- on versus off: greedy tokens equal; logits bit-equal under `--enable-deterministic-inference` (batch-invariant
  kernels: a row's result does not depend on how many rows share the call). Without it they differ in the last
  bits, because a GEMM's blocking on CPU depends on its row count (B/2 rows instead of B);
- GLM-5 (shared layers carry the top-k of the previous full layer down the stack, per micro-batch);
- the decode benchmark's synthetic top-k gives every request the same windows with it on as off;
- the pieces: `ForwardBatch.sub_batch`, the backends' state swap, when the engine turns it off.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch
from harness import Arrival, RunResult, assert_identical, make_engine, random_prompt, run_script

from decode_server.cli import build_parser, engine_config_from_args
from decode_server.config import EngineConfig
from decode_server.engine.forward_context import ForwardBatch
from decode_server.engine.two_batch import resolve_two_batch_overlap
from decode_server.model import Tokenizer, load_model, resolve_model_path

BUCKETS = [1, 2, 4]  # batches of 3 and 4 run as 4 (split 2 + 2, padded rows in the second), 5 and 6 unpadded
SMALL = {"device_budget": 8 << 20, "host_budget": 16 << 20}
CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


def workload(seed: int = 0, abort: bool = False) -> list[Arrival]:
    gen = torch.Generator().manual_seed(seed)
    # Prompts shorter and longer than D = top_k = 64 (fast path, ring, LRU misses); batch 1 → 6 → 1.
    spec = [(0, 20, 10), (0, 90, 12), (1, 70, 6), (3, 40, 8), (3, 100, 5), (4, 56, 12)]
    arrivals = [Arrival(step, f"r{i}", random_prompt(gen, n), m) for i, (step, n, m) in enumerate(spec)]
    if abort:
        arrivals[3].abort_at_step = 6
    return arrivals


def record_micro_batches(engine) -> list[tuple[tuple[int, int] | None, int]]:
    """(micro_batch, batch size) of every decode attention call the backend serves."""
    backend = engine.kv.backend
    original = backend.sparse_attention
    seen: list[tuple[tuple[int, int] | None, int]] = []

    def recording(layer_id, q, topk, scale):
        batch = backend._batch  # the micro-batch's while one is installed
        if batch.is_decode:
            seen.append((batch.micro_batch, batch.batch_size))
            assert q.shape[0] == batch.batch_size == topk.shape[0]
        return original(layer_id, q, topk, scale)

    backend.sparse_attention = recording
    return seen


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_hisparse_matches_dense_bit_for_bit(tiny_cpu, padded: bool) -> None:
    arrivals = workload(abort=True)
    common = {"two_batch": True, "eager_graph_buckets": BUCKETS if padded else None, "overlap": padded, **SMALL}
    dense_engine = make_engine(tiny_cpu, hisparse=False, **common)
    dense_seen = record_micro_batches(dense_engine)
    dense = run_script(dense_engine, arrivals)
    engine = make_engine(tiny_cpu, hisparse=True, **common)
    engine.kv.host.kv.fill_(0xFF)  # NaN in every row format: a stale read shows in the logits
    engine.kv.buffers.kv.fill_(0xFF)
    seen = record_micro_batches(engine)
    sparse = run_script(engine, arrivals)
    assert_identical(dense, sparse)
    assert sparse.finish["r3"] == "abort"
    assert seen == dense_seen
    for eng in (engine, dense_engine):
        assert eng.two_batch is not None and eng.two_batch.num_forwards > 5
        if padded:
            assert eng.graph_runner.num_eager > 0
        assert eng.is_idle_and_empty()
    # Micro-batch 0 has ceil(B/2) rows, 1 the rest (decode batches of 2 → 1 + 1, ..., 5 → 3 + 2; padded: 3 and 4
    # run as bucket 4 → 2 + 2); batches of one request run whole.
    sizes: dict[tuple[int, int] | None, set[int]] = {}
    for micro, size in seen:
        sizes.setdefault(micro, set()).add(size)
    assert sizes[(0, 2)] == {1, 2, 3} and sizes[(1, 2)] == {1, 2}
    assert None in sizes and 1 in sizes[None]
    stats = engine.stats()
    assert stats.hisparse_misses > 0, "the long path (misses from the host pool) was never exercised"
    # Padded rows (in either micro-batch) count no swap-in hit: hits + misses are the real rows' selections.
    assert [s.hits + s.misses for s in stats.hisparse_layers] == sparse.selected_per_layer


def assert_close(a: RunResult, b: RunResult, tol: float) -> float:
    worst = 0.0
    for rid, logits in a.logits.items():
        for x, y in zip(logits, b.logits[rid], strict=True):
            worst = max(worst, float((x - y).abs().max()))
    assert worst < tol, worst
    return worst


def test_on_off_same_tokens(tiny_cpu) -> None:
    arrivals = workload(seed=3)
    for hisparse in (False, True):
        off = run_script(make_engine(tiny_cpu, hisparse=hisparse, **SMALL), arrivals)
        on_engine = make_engine(tiny_cpu, hisparse=hisparse, two_batch=True, **SMALL)
        on = run_script(on_engine, arrivals)
        assert on_engine.two_batch.num_forwards > 0
        assert on.tokens == off.tokens and on.finish == off.finish
        assert_close(on, off, 1e-3)  # GEMMs of B/2 rows instead of B round differently on CPU


def test_on_off_bit_identical_when_deterministic(tiny_cpu) -> None:
    arrivals = workload(seed=4)
    off = run_script(make_engine(tiny_cpu, hisparse=True, deterministic=True, **SMALL), arrivals)
    on_engine = make_engine(tiny_cpu, hisparse=True, deterministic=True, two_batch=True, **SMALL)
    on = run_script(on_engine, arrivals)
    assert on_engine.two_batch.num_forwards > 0
    assert_identical(off, on)


@pytest.fixture(scope="module")
def tiny_glm5():
    model, config = load_model("tiny-glm5", "cpu", torch.float32)
    return model, config, Tokenizer.from_dir(resolve_model_path("tiny-glm5"))


def test_glm5_shared_layers(tiny_glm5) -> None:
    """Shared layers take their own micro-batch's top-k from the full layer above."""
    arrivals = workload(seed=5)
    off = run_script(make_engine(tiny_glm5, hisparse=False, **SMALL), arrivals)
    dense = run_script(make_engine(tiny_glm5, hisparse=False, two_batch=True, **SMALL), arrivals)
    engine = make_engine(tiny_glm5, hisparse=True, two_batch=True, eager_graph_buckets=BUCKETS, **SMALL)
    sparse = run_script(engine, arrivals)
    assert dense.tokens == off.tokens
    assert sparse.tokens == dense.tokens  # padded (eager graph buckets) vs unpadded: tokens, logits up to rounding
    assert_close(sparse, dense, 1e-3)
    padded_dense = run_script(make_engine(tiny_glm5, hisparse=False, two_batch=True, eager_graph_buckets=BUCKETS,
                                          **SMALL), arrivals)
    assert_identical(padded_dense, sparse)
    assert engine.stats().hisparse_misses > 0 and engine.is_idle_and_empty()


def test_sub_batch() -> None:
    batch = ForwardBatch.build([7, 3, 5, 9, 2], [10, 20, 30, 40, 50], [1] * 5, CPU)
    batch.is_decode = True
    batch.pad_mask = torch.tensor([False, False, False, True, True])
    sub = batch.sub_batch(3, 5, (1, 2))
    assert sub.req_rows.tolist() == [9, 2] and sub.positions.tolist() == [40, 50]
    assert sub.token_req.tolist() == [0, 1] and sub.pad_mask.tolist() == [True, True]
    assert (sub.req_rows_cpu, sub.prefix_lens_cpu, sub.seq_lens_cpu) == ([9, 2], [40, 50], [41, 51])
    assert sub.is_decode and sub.micro_batch == (1, 2) and sub.req_rows.data_ptr() == batch.req_rows[3:].data_ptr()
    with pytest.raises(ValueError, match="non-empty"):
        batch.sub_batch(2, 2, (0, 2))
    prefill = ForwardBatch.build([1, 2], [0, 0], [3, 1], CPU)
    with pytest.raises(ValueError, match="decode"):
        prefill.sub_batch(0, 1, (0, 2))


@pytest.mark.parametrize("hisparse", [False, True])
def test_backend_state_swap(tiny_cpu, hisparse: bool) -> None:
    """A micro-batch's state is its rows of every per-token tensor; swapping back restores the whole batch's."""
    engine = make_engine(tiny_cpu, hisparse=hisparse, **SMALL)
    backend = engine.kv.backend
    for name in backend.decode_row_state:
        setattr(backend, name, torch.arange(6) * 10)
    whole = ForwardBatch.build([0, 1, 2, 3, 4, 5], [4] * 6, [1] * 6, CPU)
    backend._batch = whole
    sub = whole.sub_batch(3, 6, (1, 2))
    saved = backend.swap_state(backend.micro_batch_state(sub, 3, 6))
    assert backend._batch is sub
    for name in backend.decode_row_state:
        assert getattr(backend, name).tolist() == [30, 40, 50]
    backend.swap_state(saved)
    assert backend._batch is whole and all(getattr(backend, n).numel() == 6 for n in backend.decode_row_state)


def test_flag_and_when_it_is_off(tiny_cpu, caplog) -> None:
    args = build_parser().parse_args(["serve", "--enable-two-batch-overlap"])
    assert engine_config_from_args(args).enable_two_batch_overlap
    assert not engine_config_from_args(build_parser().parse_args(["serve"])).enable_two_batch_overlap
    backend = make_engine(tiny_cpu, hisparse=True, **SMALL).kv.backend
    on = EngineConfig(enable_two_batch_overlap=True)
    assert resolve_two_batch_overlap(EngineConfig(), CPU, 1, backend) is None
    assert resolve_two_batch_overlap(on, CPU, 1, backend) is not None
    with caplog.at_level(logging.WARNING, logger="decode_server.engine.two_batch"):
        assert resolve_two_batch_overlap(on, CPU, 2, backend) is None
        native = on.model_copy(update={"attention_backend": "torch_native"})
        assert resolve_two_batch_overlap(native, torch.device("cuda"), 1, backend) is None
    assert "two-batch overlap off: --tp-size > 1" in caplog.text
    assert "two-batch overlap off: --attention-backend torch_native on CUDA" in caplog.text


def test_bench_synthetic_topk_windows(tiny_cpu) -> None:
    """benchmarks/bench_decode.py's synthetic top-k: with two-batch overlap every request gets the same window per
    layer and step as without it (each micro-batch advances its own copy of the window starts once per layer)."""
    spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "benchmarks" / "bench_decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    windows: dict[bool, dict[tuple[int, int], list[list[int]]]] = {}
    for tbo in (False, True):
        engine = make_engine(tiny_cpu, hisparse=True, two_batch=tbo, **SMALL)
        backend = engine.kv.backend
        synthetic = bench.SyntheticTopK(engine, 256, 0.25, seed=0).index_topk
        seen: dict[tuple[int, int], list[list[int]]] = {}

        def recording(layer_id, q, weights, top_k, synthetic=synthetic, seen=seen, backend=backend):
            picked = synthetic(layer_id, q, weights, top_k)
            if backend._batch.is_decode:
                for row, window in zip(backend._batch.req_rows_cpu, picked.tolist(), strict=True):
                    seen.setdefault((layer_id, row), []).append(window)
            # The model attends over its own top-k: these prompts are shorter than the synthetic context.
            return type(backend).index_topk(backend, layer_id, q, weights, top_k)

        backend.index_topk = recording
        run_script(engine, workload(seed=6))
        windows[tbo] = seen
        assert not tbo or engine.two_batch.num_forwards > 0
    assert windows[True] == windows[False]
