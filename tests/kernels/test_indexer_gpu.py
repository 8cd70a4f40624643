"""Triton lightning-indexer (kernels/indexer_triton.py) against the PyTorch reference.

The kernel computes q · k on tensor cores with q split into fp16 hi + lo parts (≈22 mantissa bits; the bf16
variant ≈16 bits), so its scores differ from the fp32 reference by up to a few 1e-6 of the largest score;
near-ties may then flip. Measured
here: score error bound, top-k overlap with the reference on random data, exact sets when the top-k is well
separated, and bit-identity of a query's scores whatever the rest of the batch is.
"""

from __future__ import annotations

import pytest
import torch

from kernels import indexer_topk
from kernels.indexer_gpu import indexer_topk_batched
from kernels.indexer_ref import indexer_topk_ref, quantize_index_keys

DEV = "cuda"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# Largest |score − fp64 score| allowed, relative to the query's largest |score| (bf16 variant ~5e-6).
SCORE_RTOL = 3e-5
FP16_SCORE_RTOL = 5e-6  # the default fp16 hi + lo split (~1e-7 under the Triton interpreter)


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


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads", [8, 16, 32, 64])
def test_indexer_triton_matches_reference(heads: int) -> None:
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
        picked = got[t].tolist()
        assert len(set(picked)) == top_k and min(picked) >= 0 and max(picked) < n
        overlaps.append(len(set(picked) & set(ref[t].tolist())) / top_k)
        s = _exact_scores(q[t], w[t], keys, scales, token_rows, int(token_req[t]), n)
        tol = SCORE_RTOL * float(s.abs().max())
        got_s, ref_s = s[got[t].long()], s[ref[t].long()]
        # Ties aside the same scores, best first.
        assert torch.allclose(got_s.sort(descending=True).values, ref_s.sort(descending=True).values, rtol=0,
                              atol=tol)
        assert bool((got_s[1:] <= got_s[:-1] + tol).all())
    assert min(overlaps) >= 0.98 and sum(overlaps) / len(overlaps) >= 0.99, overlaps


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("variant", ["default", "bf16", "heads_as_m"])
@pytest.mark.parametrize("heads", [8, 64])
def test_indexer_triton_scores_accuracy(heads: int, variant: str) -> None:
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
@pytest.mark.parametrize("heads", [8, 64])
def test_indexer_triton_exact_when_separated(heads: int) -> None:
    """A planted top-k set, scores well above the rest: the selected set must be exactly that set."""
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
        assert margin > 1e-3, margin  # the construction separates the planted set
        assert set(got[t].tolist()) == set(planted[t].tolist()) == set(ref[t].tolist())


@pytest.mark.gpu
@needs_cuda
def test_indexer_triton_query_scores_independent_of_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A query's scores and top-k are bit-identical alone, in a batch, with another span per program, and
    when the scores are computed in chunks of queries."""
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
    whole = indexer_topk_batched(*args, 2048)
    assert torch.equal(indexer_topk_batched(*args, 2048), whole)
    monkeypatch.setattr(indexer_triton, "MAX_SCORES", 2 * 5000)  # two queries per chunk
    assert torch.equal(indexer_topk_triton(*args, 2048), whole)


@pytest.mark.gpu
@needs_cuda
def test_indexer_kernel_compiles_once_as_lengths_grow() -> None:
    """Decode grows every request by one token a step: the scores kernel must not compile new variants for
    new lengths (a compile in the middle of serving costs a whole step many times over)."""
    from kernels import indexer_triton
    from kernels.indexer_triton import indexer_scores_triton

    kernel = indexer_triton._indexer_scores_kernel
    gen, keys, scales, table = _make_case(64, 5, [3000, 2500], 3100)
    q = torch.randn(2, 64, 128, generator=gen)
    w = torch.rand(2, 64, generator=gen)

    def variants() -> int:
        return sum(len(cache[0]) for cache in kernel.device_caches.values())

    q, w, keys, scales, table = _to(DEV, q, w, keys, scales, table)
    counts = []
    for max_len in range(2990, 3010):  # crosses multiples of 16 and of 64
        seq = torch.tensor([max_len, max_len - 400], device=DEV)
        # As the engine does: a slice of the device table (row stride fixed), lengths growing.
        indexer_scores_triton(q, w, keys, scales, table[:, :max_len], torch.tensor([0, 1], device=DEV), seq)
        counts.append(variants())
    assert counts[-1] == counts[0], f"compiled variants grew with the length: {counts}"


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
