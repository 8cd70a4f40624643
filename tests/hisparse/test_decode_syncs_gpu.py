"""A decode step waits for the GPU once: to read the sampled tokens. Counted two ways over steps that also grow
requests by a page: torch's sync debug mode (every synchronizing torch operation) and the CUDA runtime's
synchronizing calls seen by the profiler (which also catches extensions that sync by themselves)."""

from __future__ import annotations

import pytest
import torch
from harness import make_engine, random_prompt, torch_sync_sources

from decode_server.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def _runtime_syncs(step) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
    return sum(evt.count for evt in prof.key_averages() if evt.key in _SYNC_CALLS)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("model", ["tiny", "wide"])
@pytest.mark.parametrize("hisparse", [False, True])
def test_decode_step_syncs_once(request, model: str, hisparse: bool, overlap: bool) -> None:
    """Without overlap the one sync is the `.tolist()` of the sampled ids (a synchronizing torch operation);
    with overlap it is `cudaEventSynchronize` on the event behind the pinned copy of the previous pass's ids,
    which torch's sync debug mode does not count: at most one there, exactly one runtime sync either way."""
    tiny = request.getfixturevalue("tiny_cuda" if model == "tiny" else "wide_cuda")
    top_k = int(tiny[1].index_topk)
    # tiny: Triton attention, bf16 rows; wide: the default backend (FlashMLA where installed), FP8 rows.
    kv_dtype = "auto" if model == "tiny" else "fp8_e4m3"
    engine = make_engine(tiny, hisparse=hisparse, device="cuda", buffer_size=top_k, chunk=1024,
                         kv_cache_dtype=kv_dtype, overlap=overlap)
    assert engine.overlap is overlap
    gen = torch.Generator().manual_seed(1)
    for i in range(4):
        prompt = random_prompt(gen, top_k + 40 + 17 * i)
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    for _ in range(6):  # prefill, then warm-up decode steps (Triton compiles, FlashMLA's schedule)
        engine.step()
    sched = engine.scheduler
    assert not sched.waiting and not sched.prefilling and len(sched.running) == 4
    torch.cuda.synchronize()
    # 17 steps: every request crosses a page boundary (page size 16) at least once.
    sources = [torch_sync_sources(engine.step) for _ in range(17)]
    counts = [len(s) for s in sources]
    ok = all(c <= 1 for c in counts) if overlap else counts == [1] * 17
    assert ok, f"synchronizing torch operations per decode step: {counts}; from {sources}"
    _runtime_syncs(lambda: None)  # the process's first profiler session also initializes CUPTI
    baseline = _runtime_syncs(lambda: None)  # what the profiler itself records around an empty region
    runtime = [_runtime_syncs(engine.step) - baseline for _ in range(3)]
    assert runtime == [1] * 3, f"synchronizing CUDA runtime calls per decode step: {runtime} (baseline {baseline})"
    for i in range(4):
        engine.abort_request(f"r{i}")
    engine.step()
    assert engine.is_idle_and_empty()
