"""`narrow_linear` (the split-K float32 projection of the MoE router and the indexer's head weights) on the GPU:
float32-accurate against a float64 product (within the summation error F.linear itself has), the same bits on
every call and under CUDA-graph replay, and F.linear wherever it declines (one row, wide outputs, many rows, a K
the chunk does not divide)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from decode_server.model import layers
from decode_server.model.layers import narrow_linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def _no_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize(("rows", "n", "k"), [(8, 8, 7168), (16, 64, 7168), (51, 32, 7168), (256, 256, 7168),
                                               (16, 32, 6144)])
def test_split_k_is_float32_accurate_and_deterministic(rows: int, n: int, k: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows * n)
    x = torch.randn(rows, k, device="cuda", generator=gen)
    w = torch.randn(n, k, device="cuda", generator=gen) * k**-0.5
    exact = x.double() @ w.double().t()
    got = narrow_linear(x, w)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    # float32 sums of K products: |error| ≤ K·2⁻²⁴·Σ|x·w| in the worst case; 2⁻¹⁶ of Σ|x·w| is far above what
    # either order reaches and far below a wrong chunk (a chunk's share of the sum is ~1/28 of it).
    bound = 2.0**-16 * (x.double().abs() @ w.double().abs().t())
    assert ((got.double() - exact).abs() <= bound).all()
    for _ in range(5):
        assert torch.equal(narrow_linear(x, w), got)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=stream):
        captured = narrow_linear(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, got)


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 64, 7168), (layers.NARROW_MIN_ROWS - 1, 64, 7168), (16, 512, 7168), (layers.NARROW_MAX_ROWS + 1, 8, 7168),
                                               (16, 64, 7000)])
def test_declined_shapes_run_f_linear(rows: int, n: int, k: int) -> None:
    x = torch.randn(rows, k, device="cuda")
    w = torch.randn(n, k, device="cuda")
    assert torch.equal(narrow_linear(x, w), F.linear(x, w))
