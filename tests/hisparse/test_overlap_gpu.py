"""Overlap scheduling on CUDA (its default there): the same tokens, logprobs and finish reasons as the synchronous
loop, dense and HiSparse, with the real kernels; and the host really runs one pass ahead of the device: pass N+1 is
launched before pass N's tokens are read, and that read mostly finds them ready (the device computed pass N while
the host prepared pass N+1)."""

from __future__ import annotations

import pytest
import torch
from harness import make_engine, random_prompt
from test_overlap import drive, mixed_jobs, with_stops

from decode_server.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("hisparse", [False, True], ids=["dense", "hisparse"])
def test_overlap_equals_sync_on_cuda(tiny_cuda, hisparse: bool) -> None:
    def engine(overlap: bool | None):
        return make_engine(tiny_cuda, hisparse=hisparse, device="cuda", overlap=overlap, deterministic=True)

    assert engine(None).overlap, "overlap scheduling is on by default on CUDA"
    jobs = mixed_jobs(seed=3)
    jobs = with_stops(jobs, drive(engine(False), jobs))
    sync = drive(engine(False), jobs)
    overlapped_engine = engine(True)
    assert drive(overlapped_engine, jobs) == sync
    assert "stop" in {o.finish[0] for o in sync.values()}
    assert overlapped_engine.num_discarded_tokens > 0


@pytest.mark.parametrize("hisparse", [False, True], ids=["dense", "hisparse"])
def test_host_runs_ahead_of_the_device(tiny_cuda, hisparse: bool) -> None:
    """Eager steps (no CUDA graphs): tiny-dsa's launches then take the host longer than the device's pass, the case
    overlap is for; with graphs a replay is launched at once and the read waits for the device, as it should."""
    engine = make_engine(tiny_cuda, hisparse=hisparse, device="cuda", max_running=16, disable_cuda_graph=True)
    assert engine.overlap
    gen = torch.Generator().manual_seed(4)
    for i in range(16):
        engine.add_request(f"r{i}", random_prompt(gen, 80 + 5 * i),
                           SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    for _ in range(200):  # prefill (64-token chunks) until every request decodes
        if len(engine.scheduler.running) == 16 and not engine.scheduler.prefilling:
            break
        engine.step()
    assert len(engine.scheduler.running) == 16, "the 16 requests did not all reach decoding"
    for _ in range(8):  # warm-up of the decode steps (Triton compiles)
        engine.step()
    trace: list[tuple[str, int]] = []
    ready_at_read: list[bool] = []
    launch, process = engine._launch, engine._process

    def traced_launch(batch):
        step = launch(batch)
        trace.append(("launch", step.step_id))
        return step

    def traced_process(step):
        ready_at_read.append(step.tokens.is_ready())
        trace.append(("read", step.step_id))
        return process(step)

    engine._launch, engine._process = traced_launch, traced_process
    for _ in range(40):
        engine.step()
    torch.cuda.synchronize()
    launched = {sid: i for i, (kind, sid) in enumerate(trace) if kind == "launch"}
    reads = [(i, sid) for i, (kind, sid) in enumerate(trace) if kind == "read"]
    assert len(reads) == 40
    for i, sid in reads:
        assert launched.get(sid + 1, len(trace)) < i, f"pass {sid} was read before pass {sid + 1} was launched"
    # tiny-dsa's passes are short on the device: it finishes pass N while the host launches pass N+1, so reading
    # pass N's tokens mostly does not wait at all (without overlap every read waits for the pass just launched).
    assert sum(ready_at_read) >= len(ready_at_read) // 2, ready_at_read
    for i in range(16):
        engine.abort_request(f"r{i}")
    engine.step()
    engine.flush()
    assert engine.is_idle_and_empty()
