"""CUDA graphs of the decode step on the GPU. The contract, checked per attention kernel (Triton, FlashMLA) and KV
row format (bf16, FP8), over workloads whose decode batches go 1 → 10 → 1 requests (several buckets, padding,
batches above the largest bucket run eagerly) and grow pages and swap-in misses every few steps:

(a) a replayed step == the same padded step run eagerly (the graph runner's uncaptured path), bit for bit: tokens,
    logits (torch.equal), swap-in counters, in both modes;
(b) HiSparse == dense bit for bit with graphs on in both (same buckets), HiSparse pools NaN-poisoned;
(c) graphs on == `--disable-cuda-graph` in greedy tokens up to near-ties (logits are not promised equal there:
    padding changes the GEMM shapes and FlashMLA's split plan; a request may take another token where its two
    runs' logits are within their measured difference of a tie, and is compared up to there; see
    `compare_up_to_near_ties`). A divergence by a larger logits margin must follow a routing decision that
    flipped at a near-tie (tests/hisparse/routing_ties.py): on an H200 with the one-kernel router, dense r6 took
    another token by a margin of 0.156 against a measured logits difference of 0.082, after one flipped expert.
    (c) runs the indexer with fp16 queries: with the default e4m3 queries
    (DeepSeek's rounding, kernels/indexer_fast.py) that last-bit noise flips q's roundings by a whole e4m3 step
    and so the selected sets, which a logits margin cannot tell from a bug (on the H100 one request diverged
    by a margin of 2.4 against a measured difference of 0.14).

Run: pytest -m gpu tests/hisparse/test_cuda_graph_gpu.py -v
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from harness import Arrival, RunResult, make_engine, random_prompt, run_script
from routing_ties import explain_divergences, record_routing

import kernels.sparse_mla_flashmla as flashmla

pytestmark = pytest.mark.gpu

BUCKETS = [1, 2, 4, 8]
MAX_RUNNING = 12  # batches of 9..10 are larger than every bucket: eager, unpadded, in every engine


def workload(top_k: int, seed: int = 0, num: int = 10) -> list[Arrival]:
    gen = torch.Generator().manual_seed(seed)
    # Prompts shorter and longer than the device buffer (D = top_k): fast path, ring hits, LRU misses; 20-45
    # generated tokens cross 1-3 pages of 16; arrivals spread so the batch size changes almost every step.
    arrivals = []
    for i in range(num):
        length = top_k // 2 + 23 * (i % 10) if i % 3 else top_k + 40 + 9 * (i % 10)
        arrivals.append(Arrival(i // max(2, num // 5), f"r{i}", random_prompt(gen, length), 20 + (7 * i) % 26))
    return arrivals


def compare(what: str, a: RunResult, b: RunResult, exact: bool = True) -> float:
    """Tokens (always) and logits (bit for bit when `exact`); messages name the request, the token index and the
    largest difference. Returns the largest absolute logits difference."""
    assert a.tokens.keys() == b.tokens.keys(), f"{what}: different requests"
    for rid in a.tokens:
        ta, tb = a.tokens[rid], b.tokens[rid]
        if ta != tb:
            first = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), min(len(ta), len(tb)))
            raise AssertionError(f"{what}: {rid} tokens differ from token {first}: {ta[first:first + 4]} vs "
                                 f"{tb[first:first + 4]} (lengths {len(ta)}, {len(tb)})")
    assert a.finish == b.finish, f"{what}: finish reasons differ: {a.finish} vs {b.finish}"
    worst = 0.0
    for rid, logits in a.logits.items():
        assert len(logits) == len(b.logits[rid]), f"{what}: {rid} has {len(logits)} vs {len(b.logits[rid])} logits"
        for i, (x, y) in enumerate(zip(logits, b.logits[rid], strict=True)):
            assert not x.isnan().any() and not y.isnan().any(), f"{what}: {rid} token {i}: NaN in the logits"
            diff = float((x - y).abs().max())
            worst = max(worst, diff)
            if exact and not torch.equal(x, y):
                raise AssertionError(f"{what}: {rid} logits of token {i} differ, max abs diff {diff:.3e}")
    return worst


def compare_up_to_near_ties(what: str, a: RunResult, b: RunResult,
                            explain: Callable[[list[tuple[str, int]]], list[str]] | None = None,
                            ) -> tuple[float, list[str]]:
    """(c)'s contract. Graphs pad the batch to a bucket, so GEMM shapes and FlashMLA's split plan differ from the
    eager step and the logits differ in rounding, which a random model's MoE routing amplifies. Tokens must agree
    except where a request's two runs take different tokens at a near-tie: at the first differing token (the
    histories are identical up to there), the chosen token's margin over the other's, in either run, must not
    exceed the largest logits difference measured at the steps where the runs agreed (the bound, measured
    independently of the divergence). After a divergence the request's histories differ and are not compared.
    A divergence by a larger margin goes to `explain`, which must show it follows a routing decision that flipped
    at a near-tie (tests/hisparse/routing_ties.py: one flipped expert moves the logits far more than rounding),
    or fail. Returns (the bound, one line per divergence)."""
    assert a.tokens.keys() == b.tokens.keys(), f"{what}: different requests"
    bound, divergences = 0.0, []
    for rid in a.tokens:
        for i, (x, y) in enumerate(zip(a.tokens[rid], b.tokens[rid], strict=False)):
            if x == y:
                bound = max(bound, float((a.logits[rid][i] - b.logits[rid][i]).abs().max()))
                continue
            divergences.append((rid, i, x, y))
            break
        else:
            assert a.tokens[rid] == b.tokens[rid] and a.finish[rid] == b.finish[rid], f"{what}: {rid} ends differ"
    lines, wide = [], []
    for rid, i, x, y in divergences:
        la, lb = a.logits[rid][i], b.logits[rid][i]
        margin = max(float(la[x] - la[y]), float(lb[y] - lb[x]))
        if margin <= bound:
            lines.append(f"{rid} token {i}: {x} vs {y}, margin {margin:.3e} (bound {bound:.3e})")
            continue
        assert explain is not None, f"{what}: {rid} tokens differ from token {i} ({x} vs {y}) by a margin of " \
                                    f"{margin:.3e}, more than the largest logits difference {bound:.3e}: not a near-tie"
        wide.append((rid, i))
    if wide:
        lines += [f"{what}: {line}" for line in explain(wide)]
    assert len(divergences) <= len(a.tokens) // 3, f"{what}: {len(divergences)} of {len(a.tokens)} requests diverge"
    return bound, lines


def counters(engine) -> list[tuple[int, int]]:
    return [(s.hits, s.misses) for s in engine.stats().hisparse_layers]


CASES = [  # (model fixture, attention backend, KV cache dtype, requests)
    ("tiny_cuda", "triton", "auto", 10),
    ("tiny_cuda", "triton", "fp8_e4m3", 10),
    ("wide_cuda", "triton", "fp8_e4m3", 10),
    ("wide_cuda", "flashmla", "fp8_e4m3", 10),  # FlashMLA from batch 4 (FLASHMLA_MIN_BATCH)
    ("wide_cuda", "flashmla", "auto", 48),  # FlashMLA's bf16 kernel runs from batch 40 only
]
BIG_BUCKETS = [1, 2, 4, 8, 16, 32, 48]


@pytest.mark.parametrize(("model", "backend", "kv_cache_dtype", "num"), CASES)
def test_graph_replay_is_bit_identical(request, monkeypatch, model: str, backend: str, kv_cache_dtype: str,
                                       num: int) -> None:
    """(a) and (b)."""
    if backend == "flashmla" and not flashmla.flashmla_available():
        pytest.skip("needs a Hopper GPU and the sgl-flash-mla wheel")
    flashmla_batches: list[int] = []
    real_flashmla = flashmla.sparse_mla_decode_flashmla

    def counting(q, kv, indices, scale):
        flashmla_batches.append(int(q.shape[0]))
        return real_flashmla(q, kv, indices, scale)

    monkeypatch.setattr(flashmla, "sparse_mla_decode_flashmla", counting)
    tiny = request.getfixturevalue(model)
    top_k = int(tiny[1].index_topk)
    arrivals = workload(top_k, num=num)
    buckets = BUCKETS if num <= MAX_RUNNING else BIG_BUCKETS
    common = {"device": "cuda", "buffer_size": top_k, "max_running": max(MAX_RUNNING, num), "chunk": 512,
              "kv_cache_dtype": kv_cache_dtype, "attention_backend": backend}
    results: dict[tuple[bool, bool], RunResult] = {}
    engines = {}
    for hisparse in (False, True):
        for graphs in (True, False):
            if graphs:
                engine = make_engine(tiny, hisparse=hisparse, cuda_graph_bs=buckets, **common)
                assert engine.graph_runner is not None, f"graphs were not captured: {engine.cuda_graph_error}"
                assert engine.graph_runner.captured == buckets
            else:
                engine = make_engine(tiny, hisparse=hisparse, eager_graph_buckets=buckets, **common)
            assert engine.attention_kernel == backend
            if hisparse:
                engine.kv.host.kv.fill_(0xFF)  # NaN in every row format: a stale read shows in the logits
                engine.kv.buffers.kv.fill_(0xFF)
            results[hisparse, graphs] = run_script(engine, arrivals)
            engines[hisparse, graphs] = engine
    for hisparse in (False, True):
        mode = "HiSparse" if hisparse else "dense"
        compare(f"(a) {mode}: graph replay vs the same padded step eager", results[hisparse, True],
                results[hisparse, False])
        replayed, eager = engines[hisparse, True].graph_runner, engines[hisparse, False].graph_runner
        assert replayed.num_replays > 20 and replayed.num_eager == 0, (replayed.num_replays, replayed.num_eager)
        assert eager.num_eager == replayed.num_replays and eager.num_replays == 0
    if backend == "flashmla":
        threshold = _min_batch(kv_cache_dtype)
        assert any(b >= threshold for b in flashmla_batches), f"FlashMLA never ran (batches {flashmla_batches})"
    assert counters(engines[True, True]) == counters(engines[True, False]), "(a) swap-in counters differ"
    sparse = results[True, True]
    compare("(b) HiSparse vs dense, graphs on in both", results[False, True], sparse)
    stats = engines[True, True].stats()
    assert stats.hisparse_misses > 0, "(b) no swap-in miss: the long path was not exercised"
    # Replayed steps call no Python per layer, so the harness counts the selected entries in the eager engine.
    eager_sparse = results[True, False]
    assert [s.hits + s.misses for s in engines[True, False].stats().hisparse_layers] == (
        eager_sparse.selected_per_layer), "(b) padded rows counted swap-in hits"
    for engine in engines.values():
        assert engine.is_idle_and_empty()


def _min_batch(kv_cache_dtype: str) -> int:
    from kernels.sparse_mla_plan import FLASHMLA_MIN_BATCH

    return FLASHMLA_MIN_BATCH[(64, kv_cache_dtype == "fp8_e4m3")]


@pytest.mark.parametrize(("model", "backend", "kv_cache_dtype"), [CASES[0][:3], CASES[3][:3]])
def test_graphs_on_and_off_give_the_same_tokens(request, monkeypatch: pytest.MonkeyPatch, model: str, backend: str,
                                                kv_cache_dtype: str) -> None:
    """(c), with the default buckets (1, 2, 4, 8, 12 for 12 request rows), the indexer in fp16 (module docstring)."""
    from kernels import indexer_fast

    monkeypatch.setattr(indexer_fast, "DEFAULT_CONFIG", indexer_fast.FastScoresConfig(precision="fp16"))
    if backend == "flashmla" and not flashmla.flashmla_available():
        pytest.skip("needs a Hopper GPU and the sgl-flash-mla wheel")
    tiny = request.getfixturevalue(model)
    top_k = int(tiny[1].index_topk)
    arrivals = workload(top_k, seed=1)
    common = {"device": "cuda", "buffer_size": top_k, "max_running": MAX_RUNNING, "chunk": 512,
              "kv_cache_dtype": kv_cache_dtype, "attention_backend": backend}
    for hisparse in (False, True):
        on = make_engine(tiny, hisparse=hisparse, **common)
        assert on.graph_runner is not None, f"graphs were not captured: {on.cuda_graph_error}"
        assert on.graph_runner.captured == [1, 2, 4, 8, 12]
        off = make_engine(tiny, hisparse=hisparse, disable_cuda_graph=True, **common)
        assert off.graph_runner is None
        with_graphs, without = run_script(on, arrivals), run_script(off, arrivals)
        assert on.graph_runner.num_replays > 20

        def explain(divergences: list[tuple[str, int]], hisparse=hisparse, on=on, with_graphs=with_graphs,
                    without=without) -> list[str]:
            """Rerun both sides eagerly with the router recorded: the padded steps through the graph runner's eager
            path (bit-identical to the replays: (a)) and the unpadded ones; each must reproduce its run's tokens."""
            traces = []
            for keywords, reference in (({"eager_graph_buckets": on.graph_runner.captured}, with_graphs),
                                        ({"disable_cuda_graph": True}, without)):
                engine = make_engine(tiny, hisparse=hisparse, **keywords, **common)
                trace, remove = record_routing(engine, tiny[0])
                try:
                    rerun = run_script(engine, arrivals)
                finally:
                    remove()
                assert rerun.tokens == reference.tokens, f"the eager rerun ({keywords}) changed the tokens"
                traces.append(trace)
            return explain_divergences(traces[0], traces[1], divergences)

        bound, divergences = compare_up_to_near_ties(f"(c) hisparse={hisparse}: graphs on vs --disable-cuda-graph",
                                                     with_graphs, without, explain)
        print(f"(c) {model} {backend} {kv_cache_dtype} hisparse={hisparse}: largest logits difference {bound:.3e}; "
              + (f"near-tie divergences: {'; '.join(divergences)}" if divergences else "tokens equal"))


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_graph_steps_sync_once(tiny_cuda, overlap: bool) -> None:
    """A replayed step still waits for the GPU only to read the sampled tokens (issue 13 item 2 under graphs).
    With overlap scheduling that read is an event wait, which torch's sync debug mode does not count (at most one;
    test_decode_syncs_gpu.py counts the runtime call with the profiler)."""
    import warnings

    engine = make_engine(tiny_cuda, hisparse=True, device="cuda", buffer_size=64, cuda_graph_bs=[4], chunk=512,
                         overlap=overlap)
    assert engine.graph_runner is not None, f"graphs were not captured: {engine.cuda_graph_error}"
    gen = torch.Generator().manual_seed(5)
    for i in range(3):
        engine.add_request(f"s{i}", random_prompt(gen, 100 + 9 * i), _greedy(30))
    for _ in range(6):
        engine.step()
    torch.cuda.synchronize()
    replays = engine.graph_runner.num_replays
    counts = []
    for _ in range(10):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchronizing" in str(w.message) for w in caught))
    assert engine.graph_runner.num_replays == replays + 10
    expected_ok = all(c <= 1 for c in counts) if overlap else counts == [1] * 10
    assert expected_ok, f"synchronizing operations per replayed step (overlap {overlap}): {counts}"
    for i in range(3):
        engine.abort_request(f"s{i}")
    engine.step()
    engine.flush()
    assert engine.is_idle_and_empty()


def test_close_destroys_the_graphs_and_later_steps_run_eagerly(tiny_cuda) -> None:
    """`Engine.close()` (what a TP/DP rank does before leaving its NCCL group) destroys every captured graph, with a
    pass of the overlap schedule still in flight; the engine still finishes its requests, eagerly."""
    engine = make_engine(tiny_cuda, hisparse=True, device="cuda", buffer_size=64, cuda_graph_bs=[2, 4], chunk=512,
                         overlap=True)
    runner = engine.graph_runner
    assert runner is not None and runner.captured == [2, 4], engine.cuda_graph_error
    gen = torch.Generator().manual_seed(6)
    for i in range(3):
        engine.add_request(f"c{i}", random_prompt(gen, 90 + 7 * i), _greedy(12))
    for _ in range(5):
        engine.step()
    replays = runner.num_replays
    assert replays > 0
    engine.close()
    assert engine.graph_runner is None and runner.captured == [] and not runner._outputs
    engine.close()  # idempotent
    done = {f"c{i}": 0 for i in range(3)}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            done[delta.rid] += len(delta.new_token_ids)
    for delta in engine.flush():
        done[delta.rid] += len(delta.new_token_ids)
    assert runner.num_replays == replays
    assert sum(done.values()) > 0
    assert engine.is_idle_and_empty()


def _greedy(max_tokens: int):
    from decode_server.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
