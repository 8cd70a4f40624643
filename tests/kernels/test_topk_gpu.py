"""The top-k kernels — CUDA (kernels/topk_cuda.py, the engine's) and Triton (kernels/topk_triton.py, the wide-row
fallback) —
against the reference rule (kernels/topk_ref.py): the positions must be equal, element for element, for every
shape, length and tie pattern; plus determinism, the path each kind of row takes (Triton), no host sync, and
CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch

from kernels.topk_ref import topk_positions_ref

DEV = "cuda"
K = 2048
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


# The kernels under test: both must give the reference.
SELECTS = ("triton", "cuda")


def _topk(scores: torch.Tensor, lens: torch.Tensor, k: int = K, paths: bool = False, select: str = "triton"):
    if select == "cuda":
        from kernels.topk_cuda import topk_positions_cuda

        out = topk_positions_cuda(scores, lens, k)
        return (out, None) if paths else out
    from kernels.topk_triton import topk_positions_triton

    return topk_positions_triton(scores, lens, k, return_paths=paths)


def _assert_equal_to_reference(scores: torch.Tensor, lens: torch.Tensor, k: int = K,
                               select: str = "triton") -> torch.Tensor | None:
    got, paths = _topk(scores, lens, k, paths=True, select=select)
    want = topk_positions_ref(scores, lens, k)  # on the GPU: a stable sort of the same keys
    if not torch.equal(got, want):
        row = int((got != want).any(1).nonzero()[0])
        diff = int((got[row] != want[row]).sum())
        path = "cuda" if paths is None else int(paths[row])
        raise AssertionError(f"row {row} (len {int(lens[row])}, path {path}): {diff} entries differ; "
                             f"got {got[row, :8].tolist()}, want {want[row, :8].tolist()}")
    return paths


@pytest.mark.parametrize("select", SELECTS)
@pytest.mark.parametrize("length", [32768, 65536, 131072])
@pytest.mark.parametrize("batch", [1, 17, 64, 128])
def test_random_rows_match_reference(batch: int, length: int, select: str) -> None:
    gen = torch.Generator(device=DEV).manual_seed(batch * 1000 + length)
    scores = torch.randn(batch, length, device=DEV, generator=gen)
    lens = torch.randint(K // 2, length + 1, (batch,), device=DEV, generator=gen)
    lens[0] = length
    if batch > 4:
        lens[1:5] = torch.tensor([K - 1, K, K + 1, 8193], device=DEV)
    paths = _assert_equal_to_reference(scores, lens, select=select)
    if paths is not None:
        long_rows = lens > K
        # Random scores always take the Triton kernel's fast path (the speed depends on it).
        assert bool((paths[long_rows] == 1).all()), paths.tolist()


@pytest.mark.parametrize("select", SELECTS)
@pytest.mark.parametrize("length", [32768, 131072])
def test_ties_special_values_and_every_path(length: int, select: str) -> None:
    from kernels.topk_triton import sample_positions

    gen = torch.Generator(device=DEV).manual_seed(length)
    rows = []
    rows.append(torch.randint(0, 50, (length,), device=DEV, generator=gen).float())  # many equal scores
    rows.append(torch.full((length,), 0.25, device=DEV))  # all equal
    rows.append(torch.full((length,), float("-inf"), device=DEV))  # all −inf
    part = torch.randn(length, device=DEV, generator=gen)
    part[torch.rand(length, device=DEV, generator=gen) < 0.97] = float("-inf")  # fewer finite than K
    rows.append(part)
    special = torch.randn(length, device=DEV, generator=gen)
    pick = torch.rand(length, device=DEV, generator=gen)
    special[pick < 0.3] = 0.0
    special[(pick >= 0.3) & (pick < 0.6)] = -0.0
    special[(pick >= 0.6) & (pick < 0.61)] = float("nan")
    special[(pick >= 0.61) & (pick < 0.62)] = float("inf")
    rows.append(special)
    sampled = torch.tensor(sample_positions(length), device=DEV)
    high = torch.rand(length, device=DEV, generator=gen)
    high[sampled] += 10.0  # the sample sees only high scores: too few candidates
    rows.append(high)
    low = torch.rand(length, device=DEV, generator=gen) + 10.0
    low[sampled] -= 10.0  # the sample sees only low scores: too many candidates
    rows.append(low)
    coarse = (torch.randn(length, device=DEV, generator=gen) * 4).round()  # a few wide tie runs
    rows.append(coarse)
    # Distinct scores, then three more positions given the k-th largest score: four ties at the threshold, one
    # of them taken (the lowest position). The CUDA kernel ranks so few ties in a list (cubes spread the scores so
    # that its threshold bin holds < 4096 candidates, in shared memory, at 32K and 128K).
    few_ties = (torch.randperm(length, device=DEV, generator=gen).double() ** 3).float()
    kth = float(few_ties.topk(K).values[-1])
    below = (few_ties < kth).nonzero().flatten()
    few_ties[below[torch.randperm(below.numel(), device=DEV, generator=gen)[:3]]] = kth
    rows.append(few_ties)
    scores = torch.stack(rows)
    lens = torch.full((len(rows),), length, device=DEV)
    # For the CUDA kernel: rows 0, 1, 2 and 7 put more than its 4096 shared-memory candidates in the threshold
    # bin (the row re-read path) and need only some of the ties (the ordered tie pass).
    paths = _assert_equal_to_reference(scores, lens, select=select)
    if paths is not None:
        paths = paths.tolist()
        assert paths[1] == 2 and paths[2] == 2, paths  # the estimate is the threshold
        assert paths[5] == 3 and paths[6] == 3, paths  # the sample lied: full search
    # The same rows with shorter lengths.
    lens = torch.tensor([length - 1, 9000, 8193, 8192, K + 1, K, 20000, length // 2, length - 7], device=DEV)
    _assert_equal_to_reference(scores, lens, select=select)


@pytest.mark.parametrize("select", SELECTS)
def test_short_rows_and_narrow_tables(select: str) -> None:
    gen = torch.Generator(device=DEV).manual_seed(5)
    scores = torch.randn(6, 3000, device=DEV, generator=gen)
    lens = torch.tensor([0, 1, K - 1, K, K + 1, 5000], device=DEV)  # 5000 > L: L visible
    paths = _assert_equal_to_reference(scores, lens, select=select)
    if paths is not None:
        assert paths.tolist() == [0, 0, 0, 0, 1, 1]
    narrow = scores[:, :1000].contiguous()  # L < K: every row is short
    _assert_equal_to_reference(narrow, torch.tensor([1000, 999, 0, 1, 500, 1000], device=DEV), select=select)
    # Other k, int32 lengths, a row stride that is not the width (nor a multiple of 4: the CUDA kernel's scalar
    # loads), odd lengths.
    wide = torch.randn(5, 20001, device=DEV, generator=gen)[:, 101:19000]
    for k in (64, 256, 1000):
        _assert_equal_to_reference(wide, torch.tensor([18899, 18001, 9000, k, k + 1], device=DEV,
                                                      dtype=torch.int32), k, select=select)


@pytest.mark.parametrize("select", SELECTS)
def test_deterministic_and_row_independent(select: str) -> None:
    gen = torch.Generator(device=DEV).manual_seed(6)
    scores = torch.randint(0, 200, (40, 65536), device=DEV, generator=gen).float()
    lens = torch.randint(1, 65537, (40,), device=DEV, generator=gen)
    first = _topk(scores, lens, select=select)
    for _ in range(3):
        assert torch.equal(_topk(scores, lens, select=select), first)
    assert torch.equal(_topk(scores[7:8], lens[7:8], select=select), first[7:8])
    assert torch.equal(first, topk_positions_ref(scores, lens, K))


def test_cuda_kernel_rows_beyond_its_width_go_to_triton() -> None:
    from kernels import topk_cuda
    from kernels.cuda_ext import load_extension

    gen = torch.Generator(device=DEV).manual_seed(8)
    scores = torch.randn(2, 40000, device=DEV, generator=gen)
    lens = torch.tensor([40000, 30000], device=DEV)
    want = topk_positions_ref(scores, lens, K)
    assert topk_cuda.max_width(torch.cuda.current_device()) > 1_000_000  # DSA contexts (160K) fit many times
    assert torch.equal(topk_cuda.topk_positions(scores, lens, K), want)
    topk_cuda.max_width.cache_clear()
    real = topk_cuda.max_width
    try:
        topk_cuda.max_width = lambda index: 32768  # as if shared memory held a 32K-position bitmap only
        assert torch.equal(topk_cuda.topk_positions(scores, lens, K), want)
    finally:
        topk_cuda.max_width = real
    wider = torch.empty(1, real(torch.cuda.current_device()) + 32, device=DEV)
    with pytest.raises(ValueError, match="beyond the CUDA top-k kernel's bitmap"):
        topk_cuda.topk_positions_cuda(wider, torch.tensor([10], device=DEV), K)
    with pytest.raises(RuntimeError, match="beyond the top-k kernel's bitmap"):  # the extension's own check
        load_extension().topk_rows(wider, torch.tensor([10], device=DEV), K)


@pytest.mark.parametrize("select", SELECTS)
def test_no_host_sync_and_cuda_graph_replay(select: str) -> None:
    gen = torch.Generator(device=DEV).manual_seed(7)
    scores = torch.randn(16, 32768, device=DEV, generator=gen)
    lens = torch.randint(1, 32769, (16,), device=DEV, generator=gen)
    _topk(scores, lens, select=select)  # compile outside capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _topk(scores, lens, select=select)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _topk(scores, lens, select=select)
    for seed in range(3):
        g = torch.Generator(device=DEV).manual_seed(100 + seed)
        scores.copy_(torch.randint(0, 1000, scores.shape, device=DEV, generator=g).float())
        lens.copy_(torch.randint(1, 32769, (16,), device=DEV, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, topk_positions_ref(scores, lens, K))
