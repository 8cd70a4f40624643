"""Colocated HiSparse prefill on the device staging area (decode_server/hisparse/prefill_staging.py): bit-identical
to dense prefill (logits torch.equal, greedy tokens) with chunked prefill, bf16/fp32 and FP8 rows, on CPU and GPU;
equal to the reference gather path; a batch larger than the area falls back to that path; the area is budgeted;
on CUDA a prefill step has no more host syncs than dense prefill's and the row-copy kernel matches its reference."""

from __future__ import annotations

import pytest
import torch
from harness import Arrival, assert_identical, make_engine, random_prompt, run_script, torch_sync_sources

import kernels
from decode_server.config import EngineConfig, HiSparseConfig
from decode_server.engine import memory
from decode_server.engine.kv_alloc import PagedAllocator, RequestTokenTable
from decode_server.engine.sampling_params import SamplingParams
from decode_server.hisparse.prefill_staging import staging_bytes

FP8 = "fp8_e4m3"


def long_prompts(seed: int = 0) -> list[Arrival]:
    """A prompt of 4 chunks (64 tokens each) next to shorter ones: batches with a long prefix and new requests."""
    gen = torch.Generator().manual_seed(seed)
    spec = [(0, 200, 2), (0, 30, 2), (1, 90, 2)]
    return [Arrival(step, f"p{i}", random_prompt(gen, n), m) for i, (step, n, m) in enumerate(spec)]


def assert_same(expected, actual, what: str = "dense vs HiSparse") -> None:
    """`harness.assert_identical`, after a first check that says where and by how much the runs differ."""
    for rid, logits in expected.logits.items():
        got = actual.logits.get(rid, [])
        for i, (a, b) in enumerate(zip(logits, got, strict=False)):
            if not torch.equal(a, b):
                diff = (a.float() - b.float()).abs()
                raise AssertionError(
                    f"{what}: {rid} logits of token {i} differ: max |diff| {diff.nan_to_num(nan=float('inf')).max():.3g}, "
                    f"NaN {int(b.isnan().sum())} of {b.numel()} (NaN means a staging row was read before it was "
                    f"written); tokens {expected.tokens.get(rid)} vs {actual.tokens.get(rid)}")
    assert_identical(expected, actual)


def poison(engine) -> None:
    """0xFF is NaN in fp32, bf16, e4m3 and the FP8 rows' scales: a row read before it was written shows up."""
    co = engine.kv
    co.host.kv.fill_(0xFF)
    co.buffers.kv.fill_(0xFF)
    if co.staging is not None:
        co.staging.buf.fill_(0xFF)


def check_staged(engine, result) -> None:
    backend = engine.kv.backend
    assert backend.staged_prefill_forwards > 0, "no prefill forward ran on the staging area"
    assert backend.gathered_prefill_forwards == 0, (
        f"{backend.gathered_prefill_forwards} prefill forwards fell back to the gather path "
        f"(staging capacity {engine.kv.staging.capacity} rows)")
    assert not any(t.isnan().any() for logits in result.logits.values() for t in logits), "NaN logits"
    assert engine.is_idle_and_empty()


@pytest.mark.parametrize("kv_dtype", ["auto", FP8])
def test_staged_prefill_matches_dense(tiny_cpu, kv_dtype):
    arrivals = long_prompts()
    dense = run_script(make_engine(tiny_cpu, hisparse=False, kv_cache_dtype=kv_dtype), arrivals)
    engine = make_engine(tiny_cpu, hisparse=True, kv_cache_dtype=kv_dtype)
    poison(engine)
    sparse = run_script(engine, arrivals)
    assert_same(dense, sparse)
    check_staged(engine, sparse)
    # The first chunk's staging copies nothing; later chunks copy their prefix once per layer.
    stats = engine.stats().hisparse_layers
    assert all(s.bytes_h2d > 0 and s.bytes_d2h > 0 for s in stats)


def test_staged_prefill_equals_gather_path_and_overflow_falls_back(tiny_cpu):
    """The staging area and the reference gather path give the same bits; a staging area smaller than a batch
    (prefix included) sends that batch down the gather path, the others stay staged, and nothing changes."""
    arrivals = long_prompts(seed=1)
    staged = run_script(make_engine(tiny_cpu, hisparse=True), arrivals)
    gather_engine = make_engine(tiny_cpu, hisparse=True, prefill_staging_tokens=0)
    assert gather_engine.kv.staging is None
    gathered = run_script(gather_engine, arrivals)
    assert_same(staged, gathered, "staging area vs reference gather path")
    assert gather_engine.kv.backend.gathered_prefill_forwards > 0
    kernel = make_engine(tiny_cpu, hisparse=True)
    kernel.kv.staging.max_copy_runs = 0  # every copy through kernels.copy_rows (the gather launch on CUDA)
    poison(kernel)
    by_kernel = run_script(kernel, arrivals)
    assert_same(staged, by_kernel, "bulk copies vs row-copy kernel")
    check_staged(kernel, by_kernel)
    small = make_engine(tiny_cpu, hisparse=True, prefill_staging_tokens=100)
    poison(small)
    mixed = run_script(small, arrivals)
    assert_same(staged, mixed, "staging area vs staging area too small for some batches")
    backend = small.kv.backend
    assert backend.staged_prefill_forwards > 0 and backend.gathered_prefill_forwards > 0
    assert small.is_idle_and_empty()


def test_staging_area_is_budgeted():
    """The default area holds the longest request plus a chunk (rounded up to 64 rows) and comes out of the device
    budget; at most 1/8 of it; an explicit size wins; buffers + indexer + staging stay within the budget."""
    cpu = torch.device("cpu")
    budget = 256 << 20
    cfg = EngineConfig(device="cpu", enable_hisparse=True, page_size=16, chunked_prefill_size=2048,
                       device_kv_budget_bytes=budget, host_kv_budget_bytes=1 << 30, max_running_requests=4)
    lay = memory.plan_hisparse(cfg, cpu, num_layers=4, index_topk=128, kv_dtype=torch.bfloat16, max_ctx=8192)
    assert lay.prefill_staging_rows == 8192 + 2048
    used = (lay.num_buffers * lay.buffer_bytes + lay.indexer_pages * 16 * lay.indexer_bytes_per_token
            + lay.staging_bytes)
    assert lay.staging_bytes == staging_bytes(10240, 1152) and used <= budget
    capped = memory.plan_hisparse(cfg, cpu, num_layers=4, index_topk=128, kv_dtype=torch.bfloat16, max_ctx=163840)
    assert capped.staging_bytes <= budget // 8 and capped.prefill_staging_rows % 64 == 0
    explicit = cfg.model_copy(update={"hisparse": HiSparseConfig(prefill_staging_tokens=1000)})
    lay = memory.plan_hisparse(explicit, cpu, num_layers=4, index_topk=128, kv_dtype=torch.bfloat16, max_ctx=8192)
    assert lay.prefill_staging_rows == 1000


def test_request_runs_follow_the_pages():
    table = RequestTokenTable(PagedAllocator(16 * 8, 4), max_requests=2, max_context=32, device="cpu")
    table.ensure(0, 8)  # pages 0, 1
    table.ensure(1, 4)  # page 2
    table.ensure(0, 16)  # pages 3, 4: row 0 is pages 0 1 3 4
    assert table.runs(0, 0, 16) == [(0, 8), (12, 8)]
    assert table.runs(0, 5, 14) == [(5, 3), (12, 6)]
    assert table.runs(1, 1, 3) == [(9, 2)] and table.runs(0, 3, 3) == []
    rows = table.slots(0, 16).tolist()
    assert [r for start, n in table.runs(0, 2, 15) for r in range(start, start + n)] == rows[2:15]


def test_copy_rows_reference():
    src = torch.arange(2 * 6 * 4, dtype=torch.uint8).view(2, 6, 4)
    dst = torch.zeros((2, 5, 4), dtype=torch.uint8)
    kernels.copy_rows(src, dst, torch.tensor([5, 0, 3]), torch.tensor([1, 4, 0]))
    assert torch.equal(dst[:, 1], src[:, 5]) and torch.equal(dst[:, 4], src[:, 0]) and torch.equal(dst[:, 0], src[:, 3])
    assert not dst[:, 2:4].any()
    with pytest.raises(ValueError, match="equal-length"):
        kernels.copy_rows(src, dst, torch.tensor([1, 2]), torch.tensor([1]))


# -- GPU --

@pytest.mark.gpu
@pytest.mark.parametrize("copies", ["bulk", "kernel"])
@pytest.mark.parametrize("kv_dtype", ["auto", FP8])
def test_staged_prefill_matches_dense_on_cuda(tiny_cuda, kv_dtype, copies):
    """tiny-dsa in bf16, Triton attention; bf16 and FP8 rows; pinned host pool, side-stream staging by bulk
    copies of page runs or by the UVA row-copy kernel."""
    tiny = tiny_cuda
    arrivals = long_prompts()
    dense = run_script(make_engine(tiny, hisparse=False, device="cuda", kv_cache_dtype=kv_dtype), arrivals)
    again = run_script(make_engine(tiny, hisparse=False, device="cuda", kv_cache_dtype=kv_dtype), arrivals)
    assert_same(dense, again, "dense vs dense rerun (the model is not run-to-run deterministic here)")
    engine = make_engine(tiny, hisparse=True, device="cuda", kv_cache_dtype=kv_dtype)
    assert engine.kv.host.pinned and engine.kv.staging is not None
    if copies == "kernel":
        engine.kv.staging.max_copy_runs = 0
    poison(engine)
    sparse = run_script(engine, arrivals)
    assert_same(dense, sparse)
    check_staged(engine, sparse)
    gathered = run_script(make_engine(tiny, hisparse=True, device="cuda", kv_cache_dtype=kv_dtype,
                                      prefill_staging_tokens=0), arrivals)
    assert_same(dense, gathered, "dense vs HiSparse on the reference gather path")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flashmla"])
@pytest.mark.parametrize("kv_dtype", ["auto", FP8])
def test_staged_prefill_matches_dense_wide_on_cuda(wide_cuda, backend, kv_dtype):
    """64 heads, top-k 128: shapes FlashMLA takes (skipped where FlashMLA is not installed)."""
    if backend == "flashmla":
        from kernels.sparse_mla_flashmla import flashmla_available

        if not flashmla_available("cuda"):
            pytest.skip("FlashMLA is not installed or this is not a Hopper GPU")
    gen = torch.Generator().manual_seed(5)
    arrivals = [Arrival(0, "w0", random_prompt(gen, 700), 3), Arrival(1, "w1", random_prompt(gen, 260), 3)]
    kw = dict(device="cuda", kv_cache_dtype=kv_dtype, attention_backend=backend, buffer_size=128, chunk=256)
    dense = run_script(make_engine(wide_cuda, hisparse=False, **kw), arrivals)
    engine = make_engine(wide_cuda, hisparse=True, **kw)
    poison(engine)
    sparse = run_script(engine, arrivals)
    assert_same(dense, sparse)
    check_staged(engine, sparse)


@pytest.mark.gpu
def test_staged_prefill_syncs_no_more_than_dense(tiny_cuda):
    """Each prefill step (5 chunks of one prompt) synchronizes no more often than the same dense step."""
    gen = torch.Generator().manual_seed(2)
    prompt = random_prompt(gen, 320)
    counts = {}
    for hisparse in (False, True):
        engine = make_engine(tiny_cuda, hisparse=hisparse, device="cuda", chunk=64)
        engine.add_request("warm", prompt, SamplingParams(max_tokens=1, temperature=0.0))
        while engine.has_unfinished_requests():  # compiles kernels
            engine.step()
        # Prefill steps only (a step that frees a request may also wait for the last host write, in both modes'
        # own way): the request decodes afterwards.
        engine.add_request("r", prompt, SamplingParams(max_tokens=3, temperature=0.0))
        torch.cuda.synchronize()
        sources = []
        while not engine.scheduler.running:
            sources.append(torch_sync_sources(engine.step))
        counts[hisparse] = sources
        while engine.has_unfinished_requests():
            engine.step()
        if hisparse:
            assert engine.kv.backend.gathered_prefill_forwards == 0
    dense, sparse = counts[False], counts[True]
    assert len(dense) == len(sparse), f"steps: dense {len(dense)}, hisparse {len(sparse)}"
    extra = [(i, s, d) for i, (d, s) in enumerate(zip(dense, sparse, strict=True)) if len(s) > len(d)]
    assert not extra, "HiSparse prefill steps with more synchronizing torch ops than dense (step, hisparse " \
                      f"sources, dense sources): {extra}"


@pytest.mark.gpu
@pytest.mark.parametrize("row_bytes", [1152, 656, 100])
def test_copy_rows_cuda_matches_reference(row_bytes):
    """host → device, device → host and device → device against the PyTorch copy; 100 B rows take the byte
    loop (not 16 B aligned); destination rows not named stay untouched."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(0)
    host = torch.randint(0, 256, (3, 500, row_bytes), dtype=torch.uint8, generator=gen).pin_memory()
    dev = torch.randint(0, 256, (3, 300, row_bytes), dtype=torch.uint8, generator=gen).cuda()
    src = torch.randperm(500, generator=gen)[:200]
    dst = torch.randperm(300, generator=gen)[:200]
    for name, a, b, s, d in (("host->device", host, dev, src, dst), ("device->host", dev, host, dst, src),
                             ("device->device", dev, dev.clone(), dst[:50], dst[50:100])):
        expected = b.cpu().clone()
        expected[:, d] = a.cpu()[:, s]
        kernels.copy_rows(a, b, s.cuda(), d.cuda())
        torch.cuda.synchronize()
        assert torch.equal(b.cpu(), expected), f"{name}, {row_bytes} B rows: rows differ from the reference"
