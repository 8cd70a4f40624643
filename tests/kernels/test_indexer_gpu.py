"""The lightning indexer on the GPU against the PyTorch reference.

The engine's path (kernels/indexer_fast.py: scores kernel + top-k kernel, reached through `kernels.indexer_topk`)
rounds q to the precision of its dot (default fp8 as DeepSeek's indexer, error ≈ 3e-2 of the query's largest
score; fp16 ≈ 3e-4; `SCORE_ERROR_BOUND`), so near-ties may select differently from the fp32 reference; away from ties the sets are
equal, and the output follows the reference's rule exactly (ascending positions, the rule applied to the kernel's
own scores). The previous kernel (kernels/indexer_triton.py: q as fp16 hi + lo, torch.topk), kept for the
benchmark's comparison, is tested too. Measured here: score error bounds, selection against the exact scores,
exact sets when the top-k is well separated, bit-identity of a query's result whatever the rest of the batch is,
one compiled variant as lengths grow, no host sync, CUDA-graph replay.
"""

from __future__ import annotations

import pytest
import torch

from kernels import indexer_topk
from kernels.indexer_gpu import indexer_topk_batched
from kernels.indexer_ref import indexer_topk_ref, quantize_index_keys

DEV = "cuda"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# Previous kernel: largest |score − fp64 score| relative to the query's largest |score| (bf16 variant ~5e-6).
SCORE_RTOL = 3e-5
FP16_SCORE_RTOL = 5e-6  # its default fp16 hi + lo split (~1e-7 under the Triton interpreter)


def _make_case(heads: int, seed: int, lens_per_req: list[int], width: int, n_keys: int = 6000):
    """Random queries over requests whose token_rows are a slice of a wider table, −1 beyond each length,
    keys a view into a multi-layer cache."""
    gen = torch.Generator().manual_seed(seed)
    layers_keys, layers_scales = [], []
    for _ in range(2):
        k, s = quantize_index_keys(torch.randn(n_keys, 128, generator=gen))
        layers_keys.append(k)
        layers_scales.append(s)
    keys = torch.stack(layers_keys)[1]
    scales = torch.stack(layers_scales)[1]
    table = torch.full((len(lens_per_req), width + 77), -1, dtype=torch.int32)
    for b, n in enumerate(lens_per_req):
        table[b, :n] = torch.randperm(n_keys, generator=gen)[:n].to(torch.int32)
    return gen, keys, scales, table


def _exact_scores(q, w, keys, scales, token_rows, req: int, n: int) -> torch.Tensor:
    """Scores in fp64 (index_scores_ref computes in fp32)."""
    rows = token_rows[req, :n].long()
    logits = torch.einsum("hd,nd->hn", q.double(), keys[rows].double()).relu()
    return (w.double() @ logits) * scales[rows].double()


def _to(device: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


def _assert_selection_within_error(picked: torch.Tensor, exact: torch.Tensor, n: int, top_k: int,
                                   rtol: float) -> None:
    """`picked` (one query's output, n > top_k) is top_k distinct visible positions in ascending order, and no
    unselected position beats a selected one by more than twice the score error (ties aside, the exact top-k)."""
    positions = picked.tolist()
    assert positions == sorted(set(positions)) and len(positions) == top_k, "not ascending distinct positions"
    assert positions[0] >= 0 and positions[-1] < n
    chosen = torch.zeros(n, dtype=torch.bool)
    chosen[picked.long()] = True
    slack = 2 * rtol * float(exact.abs().max())
    worst_in, best_out = float(exact[chosen].min()), float(exact[~chosen].max())
    assert best_out <= worst_in + slack, (worst_in, best_out, slack)


# ------------------------------------------------------------------------------------- the engine's path


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads", [8, 16, 32, 64])
def test_indexer_matches_reference(heads: int) -> None:
    from kernels.indexer_fast import DEFAULT_CONFIG, SCORE_ERROR_BOUND

    lens_per_req = [3001, 2500, 700, 1000]
    width = max(lens_per_req)
    gen, keys, scales, table = _make_case(heads, heads, lens_per_req, width)
    token_rows = table[:, :width]  # non-contiguous rows, like the engine's slice
    token_req = torch.tensor([0, 1, 1, 2, 3, 0, 2, 3, 1, 0, 3, 0])
    seq_lens = torch.tensor([3001, 100, 256, 257, 999, 1500, 700, 300, 2500, 5, 1000, 2048])
    num_q, top_k = len(token_req), 256
    q = torch.randn(num_q, heads, 128, generator=gen)
    w = torch.rand(num_q, heads, generator=gen)
    ref = indexer_topk_ref(q, w, keys, scales, token_rows, token_req, seq_lens, top_k)
    got = indexer_topk(*_to(DEV, q, w, keys, scales, token_rows, token_req, seq_lens), top_k).cpu()
    assert got.dtype == torch.int32 and got.shape == (num_q, top_k)
    assert torch.equal(got < 0, ref < 0)
    overlaps = []
    for t in range(num_q):
        n = int(seq_lens[t])
        if n <= top_k:
            assert torch.equal(got[t], ref[t])
            continue
        exact = _exact_scores(q[t], w[t], keys, scales, token_rows, int(token_req[t]), n)
        _assert_selection_within_error(got[t], exact, n, top_k, SCORE_ERROR_BOUND[DEFAULT_CONFIG.precision])
        overlaps.append(len(set(got[t].tolist()) & set(ref[t].tolist())) / top_k)
    # Beyond the error bound, how much of the exact set survives the rounding of q: e4m3 (the default, as
    # DeepSeek's indexer) keeps less of it than fp16.
    low, mean = (0.9, 0.95) if DEFAULT_CONFIG.precision == "fp8" else (0.98, 0.99)
    assert min(overlaps) >= low and sum(overlaps) / len(overlaps) >= mean, overlaps


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("precision", ["fp16", "fp16x2", "fp8"])
@pytest.mark.parametrize("heads", [8, 64])
def test_fast_scores_accuracy(heads: int, precision: str) -> None:
    """Each precision of the scores kernel stays within its documented error of the fp64 scores, on random data
    and on rows whose ids point anywhere in a paged table."""
    from kernels.indexer_fast import SCORE_ERROR_BOUND, FastScoresConfig, indexer_scores_fast

    lens_per_req = [1300, 129, 1000]
    width = 1300
    gen, keys, scales, table = _make_case(heads, 100 + heads, lens_per_req, width)
    token_rows = table[:, :width]
    token_req = torch.tensor([0, 1, 2, 0, 2])
    seq_lens = torch.tensor([1300, 129, 1000, 1, 517])
    q = torch.randn(5, heads, 128, generator=gen) * 3
    w = torch.randn(5, heads, generator=gen)
    scores = indexer_scores_fast(*_to(DEV, q, w, keys, scales, token_rows, token_req, seq_lens),
                                 FastScoresConfig(precision=precision)).cpu()
    assert scores.shape == (5, width) and scores.dtype == torch.float32
    worst = 0.0
    for t in range(5):
        n = int(seq_lens[t])
        exact = _exact_scores(q[t], w[t], keys, scales, token_rows, int(token_req[t]), n)
        worst = max(worst, float((scores[t, :n].double() - exact).abs().max() / exact.abs().max()))
    assert worst <= SCORE_ERROR_BOUND[precision], worst


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads", [8, 32, 64])
def test_e4m3_query_gives_the_float_querys_scores(heads: int) -> None:
    """`quantize_query` (the form the model hands the scores kernel on CUDA) gives the fp8 kernel's own operand:
    the scores and the selection of (e4m3 q, its weights) equal those of (float q, weights · weight_scale) bit
    for bit, at one and at many queries and through the whole call; q's bytes equal an emulation of the rounding."""
    from kernels.indexer_fast import FastScoresConfig, indexer_scores_fast, indexer_topk_fast, quantize_query

    lens_per_req = [5000, 129, 3000]
    gen, keys, scales, table = _make_case(heads, 300 + heads, lens_per_req, 5000, n_keys=9000)
    token_req = torch.tensor([0, 1, 2, 0, 2, 0])
    seq_lens = torch.tensor([5000, 129, 3000, 1, 2517, 4999])
    q = torch.randn(6, heads, 128, generator=gen) * 3
    q[1, 0] *= 1e-3  # a head of small values: its own power of two scales it up
    w = torch.randn(6, heads, generator=gen)
    weight_scale = heads**-0.5 * 128**-0.5
    args = _to(DEV, keys, scales, table[:, :5000], token_req, seq_lens)
    q_d, w_d = _to(DEV, q, w)
    q8, w8 = quantize_query(q_d, w_d, weight_scale)
    shift = 7 - torch.floor(torch.log2(q.double().abs().amax(2)))
    qs = (q.double() * (2.0**shift)[..., None]).float()
    want_q = torch.where(qs.abs() < 2**-6, torch.zeros_like(qs), qs.to(torch.float8_e4m3fn).float())
    assert torch.equal(q8.float().cpu(), want_q)
    assert torch.equal(w8, (w_d * weight_scale) * (2.0 ** -shift).float().to(DEV))
    fp8 = FastScoresConfig(precision="fp8")
    want = indexer_scores_fast(q_d, w_d * weight_scale, *args, fp8)
    got = indexer_scores_fast(q8, w8, *args, fp8)
    one = indexer_scores_fast(q8[4:5], w8[4:5], args[0], args[1], args[2], args[3][4:5], args[4][4:5], fp8)
    for t, n in enumerate(seq_lens.tolist()):
        assert torch.equal(got[t, :n], want[t, :n]), t
    assert torch.equal(one[0, :2517], want[4, :2517])
    assert torch.equal(indexer_topk_fast(q8, w8, *args, 2048, fp8),
                       indexer_topk_fast(q_d, w_d * weight_scale, *args, 2048, fp8))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads", [8, 64])
def test_indexer_exact_when_separated(heads: int) -> None:
    """A planted top-k set, scores well above the rest: the selected set must be exactly that set."""
    from kernels.indexer_fast import SCORE_ERROR_BOUND

    gen = torch.Generator().manual_seed(7 + heads)
    num_q, length, top_k = 6, 4100, 512
    u = torch.randn(128, generator=gen)
    raw = 0.7 * torch.randn(num_q * length, 128, generator=gen) - 0.3 * u
    planted = torch.stack([torch.randperm(length, generator=gen)[:top_k] for _ in range(num_q)])
    for t in range(num_q):
        raw[t * length + planted[t]] += 1.3 * u
    keys, scales = quantize_index_keys(raw)
    token_rows = torch.arange(num_q * length, dtype=torch.int32).reshape(num_q, length)
    token_req = torch.arange(num_q)
    seq_lens = torch.full((num_q,), length)
    q = u + 0.3 * torch.randn(num_q, heads, 128, generator=gen)
    w = torch.rand(num_q, heads, generator=gen) + 0.1
    got = indexer_topk(*_to(DEV, q, w, keys, scales, token_rows, token_req, seq_lens), top_k).cpu()
    ref = indexer_topk_ref(q, w, keys, scales, token_rows, token_req, seq_lens, top_k)
    for t in range(num_q):
        s = _exact_scores(q[t], w[t], keys, scales, token_rows, t, length)
        others = torch.ones(length, dtype=torch.bool)
        others[planted[t]] = False
        margin = float(s[planted[t]].min() - s[others].max()) / float(s.abs().max())
        assert margin > 2 * max(SCORE_ERROR_BOUND.values()), margin  # separated beyond every precision's error
        assert set(got[t].tolist()) == set(planted[t].tolist()) == set(ref[t].tolist())
        assert got[t].tolist() == ref[t].tolist()  # same set, same (ascending) order


@pytest.mark.gpu
@needs_cuda
def test_indexer_result_independent_of_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A query's scores and top-k are bit-identical alone, in a batch, with another span per program, and when
    queries are processed in chunks; and the top-k is the rule applied to the kernel's own scores."""
    from kernels import indexer_fast
    from kernels.indexer_fast import FastScoresConfig, indexer_scores_fast, indexer_topk_fast
    from kernels.topk_ref import topk_positions_ref

    lens_per_req = [5000, 3000, 4500]
    gen, keys, scales, table = _make_case(64, 3, lens_per_req, 5000, n_keys=9000)
    token_rows, token_req = table[:, :5000], torch.tensor([0, 1, 2, 2, 0, 1, 0])
    seq_lens = torch.tensor([5000, 3000, 4500, 2049, 4000, 1200, 2048])
    q = torch.randn(7, 64, 128, generator=gen)
    w = torch.rand(7, 64, generator=gen)
    args = _to(DEV, q, w, keys, scales, token_rows, token_req, seq_lens)
    visible = torch.arange(5000).unsqueeze(0) < seq_lens.unsqueeze(1)  # beyond seq_len nothing is written
    full = indexer_scores_fast(*args).cpu()
    for per_prog in (1, 3, 40):
        other = indexer_scores_fast(*args, config=FastScoresConfig(blocks_per_program=per_prog)).cpu()
        assert torch.equal(other[visible], full[visible])
    for t in (0, 3):
        single = [a[t:t + 1] if i in (0, 1, 5, 6) else a for i, a in enumerate(args)]
        n = int(seq_lens[t])
        assert torch.equal(indexer_scores_fast(*single).cpu()[0, :n], full[t, :n])
    whole = indexer_topk_batched(*args, 2048)
    assert torch.equal(whole.cpu(), topk_positions_ref(full, seq_lens, 2048))
    assert torch.equal(indexer_topk_batched(*args, 2048), whole)
    monkeypatch.setattr(indexer_fast, "MAX_CHUNK_BYTES", 2 * (4 * 5000 + 8 * 8192))  # two queries per chunk
    assert indexer_fast.queries_per_chunk(5000, 2048) == 2
    assert torch.equal(indexer_topk_fast(*args, 2048), whole)


@pytest.mark.gpu
@needs_cuda
def test_indexer_kernels_compile_once_as_lengths_grow() -> None:
    """Decode grows every request by one token a step: neither kernel may compile new variants for new lengths
    (a compile in the middle of serving costs a whole step many times over)."""
    from kernels import indexer_fast, topk_triton
    from kernels.indexer_fast import indexer_topk_fast

    kernels = (indexer_fast._scores_kernel, indexer_fast._scores_balanced_kernel, topk_triton._topk_kernel)
    gen, keys, scales, table = _make_case(64, 5, [3000, 2500], 3100)
    q = torch.randn(2, 64, 128, generator=gen)
    w = torch.rand(2, 64, generator=gen)

    def variants() -> int:
        return sum(len(cache[0]) for kernel in kernels for cache in kernel.device_caches.values())

    q, w, keys, scales, table = _to(DEV, q, w, keys, scales, table)
    q8, w8 = indexer_fast.quantize_query(q, w)
    counts = []
    for max_len in range(2990, 3010):  # crosses multiples of 16 and of 64
        seq = torch.tensor([max_len, max_len - 400], device=DEV)
        # As the engine does: a slice of the device table (row stride fixed), lengths growing.
        indexer_topk_fast(q, w, keys, scales, table[:, :max_len], torch.tensor([0, 1], device=DEV), seq, 256)
        # and an e4m3 query through the balanced kernel, started early
        indexer_topk_fast(q8, w8, keys, scales, table[:, :max_len], torch.tensor([0, 1], device=DEV), seq, 256,
                          indexer_fast.FastScoresConfig(balanced=True), tables_ready=True)
        counts.append(variants())
    assert counts[-1] == counts[0], f"compiled variants grew with the length: {counts}"


@pytest.mark.gpu
@needs_cuda
def test_indexer_no_host_sync_and_cuda_graph_replay() -> None:
    """The whole call is capturable: no host sync, allocations sized by shapes; a replay with new queries and
    lengths gives what an eager call gives."""
    from kernels.indexer_fast import indexer_topk_fast

    gen, keys, scales, table = _make_case(64, 9, [9000, 7000, 12000], 12000, n_keys=30000)
    q = torch.randn(3, 64, 128, generator=gen)
    w = torch.randn(3, 64, generator=gen)
    seq = torch.tensor([9000, 7000, 12000])
    q, w, keys, scales, table, seq = _to(DEV, q, w, keys, scales, table, seq)
    token_rows, req = table[:, :12000], torch.arange(3, device=DEV)
    indexer_topk_fast(q, w, keys, scales, token_rows, req, seq, 2048)  # compile outside capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        indexer_topk_fast(q, w, keys, scales, token_rows, req, seq, 2048)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = indexer_topk_fast(q, w, keys, scales, token_rows, req, seq, 2048)
    for step in range(3):
        q.copy_(torch.randn(q.shape, device=DEV))
        seq.copy_(torch.tensor([9000 - step, 1000 + step, 12000 - 7 * step], device=DEV))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, indexer_topk_fast(q, w, keys, scales, token_rows, req, seq, 2048))


@pytest.mark.gpu
@needs_cuda
def test_write_index_rows_is_the_indexed_assignment() -> None:
    """The one-kernel index-key write (the engine's, both modes) leaves the bytes indexed assignment leaves, on a
    view of a multi-layer cache; rows < 0 are skipped."""
    from kernels.indexer_fast import write_index_rows

    gen = torch.Generator().manual_seed(4)
    cache_keys, cache_scales = quantize_index_keys(torch.randn(3 * 5000, 128, generator=gen))
    cache_keys, cache_scales = _to(DEV, cache_keys.view(3, 5000, 128), cache_scales.view(3, 5000))
    for num in (1, 17, 64, 300):
        keys, scales = _to(DEV, *quantize_index_keys(torch.randn(num, 128, generator=gen)))
        rows = torch.randperm(5000, generator=gen)[:num].to(DEV)
        rows[num // 2] = -1
        want_keys, want_scales = cache_keys.clone(), cache_scales.clone()
        kept = rows >= 0
        want_keys[1, rows[kept]] = keys[kept]
        want_scales[1, rows[kept]] = scales[kept]
        write_index_rows(cache_keys[1], cache_scales[1], rows, keys, scales)
        assert torch.equal(cache_keys.view(torch.uint8), want_keys.view(torch.uint8))
        assert torch.equal(cache_scales, want_scales)


@pytest.mark.gpu
@needs_cuda
def test_early_started_scores_after_the_write_give_the_same_bits() -> None:
    """The engine's order — index-key write, then the scores launched early (`tables_ready`, programmatic
    dependent launch on Hopper) — scores the keys the write just stored: eager and in a replayed CUDA graph, the
    scores and the selection equal those of the plain launch, including the new token's position."""
    from kernels.indexer_fast import indexer_scores_fast, indexer_topk_fast, quantize_query, write_index_rows

    gen, keys, scales, table = _make_case(64, 12, [9000, 4000, 12000, 700], 12000, n_keys=40000)
    q = torch.randn(4, 64, 128, generator=gen)
    w = torch.randn(4, 64, generator=gen)
    seq = torch.tensor([9000, 4000, 12000, 700])
    q, w, keys, scales, table, seq = _to(DEV, q, w, keys, scales, table, seq)
    q8, w8 = quantize_query(q, w)
    token_rows, req = table[:, :12000], torch.arange(4, device=DEV)
    new_rows = table[req, seq - 1].long()

    def new_keys() -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_index_keys(torch.randn(4, 128, device=DEV))

    def engine_order(k: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        write_index_rows(keys, scales, new_rows, k, s)
        scores = indexer_scores_fast(q8, w8, keys, scales, token_rows, req, seq, tables_ready=True)
        write_index_rows(keys, scales, new_rows, k, s)
        return scores, indexer_topk_fast(q8, w8, keys, scales, token_rows, req, seq, 2048, tables_ready=True)

    def plain(k: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys[new_rows], scales[new_rows] = k, s
        return (indexer_scores_fast(q8, w8, keys, scales, token_rows, req, seq),
                indexer_topk_fast(q8, w8, keys, scales, token_rows, req, seq, 2048))

    def assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
        for t, n in enumerate(seq.tolist()):
            assert torch.equal(got[0][t, :n], want[0][t, :n]), f"query {t}: scores differ"
        assert torch.equal(got[1], want[1])

    k, s = new_keys()
    assert_same(engine_order(k, s), plain(k, s))  # eager (also compiles outside the capture)
    k_in, s_in = new_keys()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = engine_order(k_in, s_in)
    for _ in range(3):  # each replay writes new keys at the last positions, then scores them
        k, s = new_keys()
        k_in.copy_(k)
        s_in.copy_(s)
        graph.replay()
        torch.cuda.synchronize()
        assert_same(out, plain(k, s))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tables_ready", [False, True])
def test_a_row_with_no_position_selects_nothing(tables_ready: bool) -> None:
    """A query that sees 0 positions (a CUDA-graph batch's padded row: `ForwardBatch.indexer_query_lens`) gets
    only -1, and the other rows are what they are without it (plain and early-started scores)."""
    from kernels.indexer_fast import indexer_topk_fast, quantize_query

    gen, keys, scales, table = _make_case(64, 21, [9000, 5000, 7000], 9000, n_keys=20000)
    q = torch.randn(3, 64, 128, generator=gen)
    w = torch.randn(3, 64, generator=gen)
    q, w, keys, scales, table = _to(DEV, q, w, keys, scales, table)
    q8, w8 = quantize_query(q, w)
    token_rows, req = table[:, :9000], torch.arange(3, device=DEV)
    got = indexer_topk_fast(q8, w8, keys, scales, token_rows, req, torch.tensor([9000, 0, 7000], device=DEV), 2048,
                            tables_ready=tables_ready)
    assert (got[1] == -1).all()
    for t, n in ((0, 9000), (2, 7000)):
        alone = indexer_topk_fast(q8[t : t + 1], w8[t : t + 1], keys, scales, token_rows, req[t : t + 1],
                                  torch.tensor([n], device=DEV), 2048)
        assert torch.equal(got[t], alone[0])


def test_indexer_all_short_is_dense_everywhere() -> None:
    """Every request within top_k: positions 0..n-1 then −1, on CPU (torch fallback) and on the GPU if any."""
    gen = torch.Generator().manual_seed(5)
    keys, scales = quantize_index_keys(torch.randn(100, 128, generator=gen))
    token_rows = torch.randperm(100, generator=gen)[:60].to(torch.int32).reshape(2, 30)
    q, w = torch.randn(3, 8, 128, generator=gen), torch.rand(3, 8, generator=gen)
    token_req, seq_lens = torch.tensor([0, 1, 1]), torch.tensor([30, 1, 17])
    expect = indexer_topk_ref(q, w, keys, scales, token_rows, token_req, seq_lens, 32)
    assert torch.equal(expect[2], torch.cat([torch.arange(17), torch.full((15,), -1)]).to(torch.int32))
    assert torch.equal(indexer_topk_batched(q, w, keys, scales, token_rows, token_req, seq_lens, 32), expect)
    if torch.cuda.is_available():
        got = indexer_topk_batched(*_to(DEV, q, w, keys, scales, token_rows, token_req, seq_lens), 32)
        assert torch.equal(got.cpu(), expect)


def test_torch_fallback_with_padded_rows_matches_reference() -> None:
    """CPU path (no Triton needed): −1 rows beyond each request's length, several queries per request."""
    gen, keys, scales, table = _make_case(8, 9, [300, 90, 200], 300, n_keys=700)
    token_rows = table[:, :300]
    token_req, seq_lens = torch.tensor([0, 0, 1, 2, 2]), torch.tensor([300, 41, 90, 200, 150])
    q, w = torch.randn(5, 8, 128, generator=gen), torch.rand(5, 8, generator=gen)
    expect = indexer_topk_ref(q, w, keys, scales, token_rows, token_req, seq_lens, 40)
    assert torch.equal(indexer_topk_batched(q, w, keys, scales, token_rows, token_req, seq_lens, 40), expect)


# ----------------------------------------------------------------- the previous kernel (benchmark baseline)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("variant", ["default", "bf16", "heads_as_m"])
@pytest.mark.parametrize("heads", [8, 64])
def test_previous_kernel_scores_accuracy(heads: int, variant: str) -> None:
    from kernels.indexer_triton import ScoresConfig, indexer_scores_triton

    config = {"default": ScoresConfig(), "bf16": ScoresConfig(fp16=False),
              "heads_as_m": ScoresConfig(heads_as_m=True, block_n=128)}[variant]
    lens_per_req = [1300, 129, 1000]
    width = 1300
    gen, keys, scales, table = _make_case(heads, 100 + heads, lens_per_req, width)
    token_rows = table[:, :width]
    token_req = torch.tensor([0, 1, 2, 0, 2])
    seq_lens = torch.tensor([1300, 129, 1000, 1, 517])
    q = torch.randn(5, heads, 128, generator=gen) * 3
    w = torch.rand(5, heads, generator=gen)
    scores = indexer_scores_triton(*_to(DEV, q, w, keys, scales, token_rows, token_req, seq_lens), config).cpu()
    assert scores.shape == (5, width) and scores.dtype == torch.float32
    worst = 0.0
    for t in range(5):
        n = int(seq_lens[t])
        exact = _exact_scores(q[t], w[t], keys, scales, token_rows, int(token_req[t]), n)
        worst = max(worst, float((scores[t, :n].double() - exact).abs().max() / exact.abs().max()))
        assert bool(torch.isneginf(scores[t, n:]).all())
    assert worst <= (SCORE_RTOL if variant == "bf16" else FP16_SCORE_RTOL), worst


@pytest.mark.gpu
@needs_cuda
def test_previous_path_independent_of_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The previous path (scores + torch.topk): a query's scores are bit-identical alone, in a batch, with another
    span per program; its top-k selects the same set as the engine's path on well-separated data."""
    from kernels import indexer_triton
    from kernels.indexer_triton import ScoresConfig, indexer_scores_triton, indexer_topk_triton

    lens_per_req = [5000, 3000, 4500]
    gen, keys, scales, table = _make_case(64, 3, lens_per_req, 5000, n_keys=9000)
    token_rows, token_req = table[:, :5000], torch.tensor([0, 1, 2, 2, 0, 1, 0])
    seq_lens = torch.tensor([5000, 3000, 4500, 2049, 4000, 1200, 2048])
    q = torch.randn(7, 64, 128, generator=gen)
    w = torch.rand(7, 64, generator=gen)
    args = _to(DEV, q, w, keys, scales, token_rows, token_req, seq_lens)
    full = indexer_scores_triton(*args)
    for per_prog in (1, 3, 40):
        assert torch.equal(indexer_scores_triton(*args, config=ScoresConfig(blocks_per_program=per_prog)), full)
    for t in (0, 3):
        single = [a[t:t + 1] if i in (0, 1, 5, 6) else a for i, a in enumerate(args)]
        assert torch.equal(indexer_scores_triton(*single), full[t:t + 1])
    whole = indexer_topk_triton(*args, 2048)
    monkeypatch.setattr(indexer_triton, "MAX_SCORES", 2 * 5000)  # two queries per chunk
    assert torch.equal(indexer_topk_triton(*args, 2048), whole)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tables_ready", [False, True])
def test_balanced_split_gives_the_per_query_kernels_bits(tables_ready: bool) -> None:
    """The balanced kernel (`FastScoresConfig(balanced=True)`: every program takes an even share of the batch's
    blocks, across queries) against the per-query kernel on mixed lengths (0, 1, short, long), at several grids,
    eager and in a CUDA graph replayed with new lengths (the split is made in the kernel from them)."""
    from kernels.indexer_fast import FastScoresConfig, indexer_scores_fast, quantize_query

    lens = [9000, 0, 4000, 12000, 700, 1, 64, 12000]
    gen, keys, scales, table = _make_case(64, 21, lens, 12000, n_keys=40000)
    q = torch.randn(8, 64, 128, generator=gen)
    w = torch.randn(8, 64, generator=gen)
    seq = torch.tensor(lens)
    q, w, keys, scales, table, seq = _to(DEV, q, w, keys, scales, table, seq)
    q8, w8 = quantize_query(q, w)
    token_rows, req = table[:, :12000], torch.arange(8, device=DEV)

    def check(got: torch.Tensor, lengths: torch.Tensor) -> None:
        want = indexer_scores_fast(q8, w8, keys, scales, token_rows, req, lengths, FastScoresConfig(balanced=False))
        for t, n in enumerate(lengths.tolist()):
            assert torch.equal(got[t, :n], want[t, :n]), f"query {t} (length {n}): scores differ"

    for programs in (None, 1, 3, 8):
        got = indexer_scores_fast(q8, w8, keys, scales, token_rows, req, seq,
                                  FastScoresConfig(balanced=True, programs_per_sm=programs), tables_ready=tables_ready)
        check(got, seq)
    lengths = seq.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = indexer_scores_fast(q8, w8, keys, scales, token_rows, req, lengths, FastScoresConfig(balanced=True),
                                  tables_ready=tables_ready)
    for _ in range(3):
        lengths.copy_(torch.randint(0, 12001, (8,), generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        check(out, lengths)
