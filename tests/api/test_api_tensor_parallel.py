"""`decode-server serve --tp-size 2` on CPU (gloo, tiny-dsa): real servers, the openai client.

- greedy outputs of a batch equal the single-rank engine's, dense (with `--ep-size 2`, synchronous) and HiSparse
  (`--ep-size 1`, overlap scheduling forced on, as it is by default on CUDA);
- prefix caching (the dense server runs with `--enable-prefix-caching`): a prompt sharing a prefix with an earlier
  one reuses its pages on every rank alike (same pool usage and tokens), with the single-rank engine's text;
- sampled requests without a seed complete, and every rank produced the same tokens (per-rank digests);
- aborted / disconnected requests free the pools of every rank; retractions (a host pool of 8 pages) happen in step
  on every rank (slow);
- the HiSparse host pool is one shared-memory region that both ranks map, unlinked from /dev/shm;
- a clean stop leaves no rank behind; killing rank 1 mid-stream ends the request with a clear error, /health
  answers 503, the server exits non-zero, and no rank process or shared-memory file is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from api_server_harness import ServerProcess, assert_clean_exit, flush_cache, pid_alive, wait_until_idle

from decode_server.engine.llm import LLM
from decode_server.engine.sampling_params import SamplingParams
from decode_server.hisparse.shared_host import SHM_DIR, SHM_PREFIX

MODEL = "tiny-dsa"
# device_buffer_size == index_topk (64): prompts longer than that swap rows in from the shared host pool.
HISPARSE_ARGS = ("--enable-hisparse", "--hisparse-config", '{"device_buffer_size": 64, "num_recent_slots": 4}')
PROMPTS = [" ".join(f"w{(i * 31 + j) % 97}" for j in range(24 + 3 * i)) for i in range(6)]
MAX_TOKENS = 10


def _rank_pids(server: ServerProcess, overlap: bool) -> list[int]:
    info = httpx.get(server.url + "/server_info", timeout=10).json()
    assert info["engine"]["overlap_schedule"] is overlap and info["engine"]["cuda_graph_batch_sizes"] == []  # CPU
    pids = info["engine"]["tp_rank_pids"]
    assert len(pids) == 2 and pids[0] == server.engine_pid
    return pids


def _ranks_agree(server: ServerProcess) -> dict:
    """Every rank reports the same steps, tokens (digest) and pool usage as rank 0."""
    stats = server.stats()
    ranks = stats["tp_ranks"]
    assert [r["tp_rank"] for r in ranks] == [0, 1]
    keys = ("num_steps", "num_generated_tokens", "token_digest", "host_pages_used", "device_slots_used",
            "indexer_slots_used", "dense_kv_slots_used")  # fmt: skip
    assert {k: ranks[0][k] for k in keys} == {k: ranks[1][k] for k in keys}, ranks
    return stats


def _wait_idle_everywhere(server: ServerProcess) -> None:
    """No request and every pool of every rank empty (a prefix cache's pages dropped first: they stay allocated)."""
    if wait_until_idle(server)["prefix_cache"] is not None:
        _ranks_agree(server)  # the same pages cached on every rank
        flush_cache(server)
    deadline = time.monotonic() + 10
    while True:
        ranks = _ranks_agree(server)["tp_ranks"]
        used = [r[k] for r in ranks for k in ("host_pages_used", "device_slots_used", "indexer_slots_used",
                                               "dense_kv_slots_used")]  # fmt: skip
        if not any(used):
            return
        assert time.monotonic() < deadline, ranks
        time.sleep(0.1)


def _assert_gone(pids: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if pid_alive(p)], f"rank processes {pids} outlived the server"


def _shm_files(rank0_pid: int) -> list[Path]:
    return sorted(SHM_DIR.glob(f"{SHM_PREFIX}{rank0_pid}-*"))


def _completions(server: ServerProcess, prompts: list[str], **kwargs: object) -> list:
    async def run_all() -> list:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        async with client:
            return await asyncio.gather(*(client.completions.create(model=MODEL, prompt=p, **kwargs)
                                          for p in prompts))  # fmt: skip

    return asyncio.run(run_all())


@pytest.fixture(scope="module")
def tp1_outputs(offline_llm: LLM) -> list[str]:
    """The single-rank engine's greedy texts (dense; HiSparse equals dense, tests/hisparse)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = offline_llm.generate(PROMPTS, params)
    assert all(len(o.prompt_token_ids) + MAX_TOKENS > 64 for o in outs[3:]), "prompts too short to swap in"
    return [o.text for o in outs]


@pytest.fixture(scope="module")
def dense_tp2() -> Iterator[ServerProcess]:
    # experts split across the ranks; prefix caching on (the other tests send no shared prefix: no hit changes them)
    server = ServerProcess("--tp-size", "2", "--ep-size", "2", "--enable-prefix-caching").wait_ready()
    pids = _rank_pids(server, overlap=False)
    try:
        yield server
    finally:
        try:  # a clean stop: exit 0 and every rank gone
            code = server.stop(signal.SIGTERM)
            assert_clean_exit(server, code)
            _assert_gone(pids)
        finally:
            server.kill()


@pytest.fixture(scope="module")
def hisparse_tp2() -> Iterator[ServerProcess]:
    # overlap scheduling forced on (CUDA's default; off by default on CPU): the lockstep ranks one pass ahead
    server = ServerProcess("--tp", "2", *HISPARSE_ARGS, "--force-overlap-schedule").wait_ready()
    pids = _rank_pids(server, overlap=True)
    try:
        yield server
    finally:
        try:
            server.kill()
        finally:
            for pid in pids:
                if pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)


def test_dense_tp2_greedy_equals_tp1(dense_tp2: ServerProcess, tp1_outputs: list[str]) -> None:
    outs = _completions(dense_tp2, PROMPTS, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    assert [o.choices[0].text for o in outs] == tp1_outputs
    _wait_idle_everywhere(dense_tp2)
    info = httpx.get(dense_tp2.url + "/server_info", timeout=10).json()["engine"]
    assert info["tp_size"] == 2 and info["ep_size"] == 2 and info["mode"] == "dense"


def test_dense_tp2_prefix_caching_agrees_across_ranks(dense_tp2: ServerProcess, offline_llm: LLM) -> None:
    """Every rank maps the same cached prefix (the ranks' schedulers and caches stay identical): the usage says 192
    tokens (3 pages of 64) came from the cache, the text is the single-rank engine's, every rank reports the same
    pool usage and token digest, and /flush_cache drops the same pages everywhere."""
    shared = [(7 * i) % 1000 + 5 for i in range(200)]
    prompts = [shared + [11, 12], shared + [13, 14, 15]]
    outs = [_completions(dense_tp2, [p], max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})[0]
            for p in prompts]  # one after the other: the second finds the first's pages
    assert [o.usage.prompt_tokens_details.cached_tokens for o in outs] == [0, 192]
    expected = offline_llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    assert [o.choices[0].text for o in outs] == [e.text for e in expected]
    stats = wait_until_idle(dense_tp2)
    ranks = _ranks_agree(dense_tp2)["tp_ranks"]
    assert ranks[0]["dense_kv_slots_used"] == stats["prefix_cache"]["cached_tokens"] >= 192  # all cached pages
    assert flush_cache(dense_tp2) == {"prefix_caching": True, "dropped_tokens": stats["prefix_cache"]["cached_tokens"]}
    _wait_idle_everywhere(dense_tp2)  # every rank's pool empty after the flush


def test_unseeded_sampling_agrees_across_ranks(dense_tp2: ServerProcess) -> None:
    outs = _completions(dense_tp2, PROMPTS[:4], max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95,
                        extra_body={"ignore_eos": True})  # fmt: skip
    assert all(o.choices[0].finish_reason == "length" and o.usage.completion_tokens == MAX_TOKENS for o in outs)
    _wait_idle_everywhere(dense_tp2)  # a divergent sample would show as different digests or a hang


def test_penalties_agree_across_ranks(dense_tp2: ServerProcess, offline_llm: LLM) -> None:
    """Every rank keeps the same counts: a penalized greedy batch equals the single-rank engine's, and penalized
    sampling without a seed leaves every rank with the same tokens (digests)."""
    edits = {"frequency_penalty": 1.2, "presence_penalty": 0.4, "logit_bias": {"7": 5.0, "11": 5.0}}
    extra = {"ignore_eos": True, "repetition_penalty": 1.4, "min_tokens": 2}
    outs = _completions(dense_tp2, PROMPTS[:3], max_tokens=MAX_TOKENS, temperature=0, extra_body=extra, **edits)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, frequency_penalty=1.2,
                            presence_penalty=0.4, logit_bias={7: 5.0, 11: 5.0}, repetition_penalty=1.4, min_tokens=2)
    assert [o.choices[0].text for o in outs] == [e.text for e in offline_llm.generate(PROMPTS[:3], params)]
    outs = _completions(dense_tp2, PROMPTS[:4], max_tokens=MAX_TOKENS, temperature=0.9, extra_body=extra, **edits)
    assert all(o.usage.completion_tokens == MAX_TOKENS for o in outs)
    _wait_idle_everywhere(dense_tp2)


def test_disconnects_free_every_rank(dense_tp2: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "Go on:", "max_tokens": 200, "ignore_eos": True, "temperature": 0.7,
            "stream": True}  # fmt: skip

    def disconnect_after_two_chunks() -> None:
        with httpx.stream("POST", dense_tp2.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: ")
                if chunks >= 2:
                    return  # closing the connection aborts the request

    for _ in range(3):
        disconnect_after_two_chunks()
    _wait_idle_everywhere(dense_tp2)


def test_hisparse_tp2_greedy_equals_tp1(hisparse_tp2: ServerProcess, tp1_outputs: list[str]) -> None:
    outs = _completions(hisparse_tp2, PROMPTS, max_tokens=MAX_TOKENS, temperature=0,
                        extra_body={"ignore_eos": True})  # fmt: skip
    assert [o.choices[0].text for o in outs] == tp1_outputs
    stats = _ranks_agree(hisparse_tp2)
    assert sum(layer["misses"] for layer in stats["hisparse_layers"]) > 0  # rows came from the shared pool
    _wait_idle_everywhere(hisparse_tp2)


def test_hisparse_host_pool_is_one_shared_region(hisparse_tp2: ServerProcess) -> None:
    pids = _rank_pids(hisparse_tp2, overlap=True)
    maps = []
    for pid in pids:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        maps.append({line.split(None, 5)[5] for line in lines if SHM_PREFIX in line})
    assert maps[0] and maps[0] == maps[1], maps  # the same region in both ranks
    assert all(name.endswith("(deleted)") for name in maps[0])  # already unlinked: nothing to leak
    assert _shm_files(pids[0]) == []


@pytest.fixture(scope="module")
def tight_tp2() -> Iterator[ServerProcess]:
    """HiSparse with a host pool of 8 pages of 64 tokens: a burst of growing requests must retract some."""
    page_bytes = 64 * 2304 * 3  # tokens x fp32 MLA row x tiny-dsa's layers
    server = ServerProcess("--tp", "2", *HISPARSE_ARGS, "--host-kv-budget", str(8 * page_bytes),
                           "--force-overlap-schedule").wait_ready()
    pids = _rank_pids(server, overlap=True)
    try:
        yield server
    finally:
        try:
            code = server.stop(signal.SIGTERM)
            assert_clean_exit(server, code)
            _assert_gone(pids)
        finally:
            server.kill()


@pytest.mark.slow  # about 400 steps of two ranks on CPU
def test_retractions_stay_in_step_across_ranks(tight_tp2: ServerProcess) -> None:
    # Admitted at about 2 expected pages each (SGLang's new-token ratio), they grow to 3: the pool's 8 run out.
    prompts = [f"Tell me about w{i}" for i in range(6)]
    outs = _completions(tight_tp2, prompts, max_tokens=140, temperature=0.8, extra_body={"ignore_eos": True})
    assert all(o.choices[0].finish_reason == "length" and o.usage.completion_tokens == 140 for o in outs)
    stats = _ranks_agree(tight_tp2)
    assert stats["num_retractions"] > 0 and stats["host_pages"]["total"] == 8
    _wait_idle_everywhere(tight_tp2)


def test_killing_rank1_ends_the_server_cleanly(hisparse_tp2: ServerProcess) -> None:
    server = hisparse_tp2
    pids = _rank_pids(server, overlap=True)
    body = {"model": MODEL, "prompt": "Go on:", "max_tokens": 100, "ignore_eos": True, "temperature": 0,
            "stream": True}  # fmt: skip
    payloads: list[str] = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                payloads.append(line[len("data: "):])
                if len(payloads) == 2:
                    os.kill(pids[1], signal.SIGKILL)
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert error["type"] == "engine_unavailable" and "tensor-parallel rank 1" in error["message"], error
    try:
        health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]
    except httpx.TransportError:
        pass  # already exited: not hanging either
    assert server.proc.wait(30) != 0
    _assert_gone(pids + server.children)
    assert _shm_files(pids[0]) == []
    assert "tensor-parallel rank 1" in server.log_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--tp-size", "0"], "greater than or equal to 1"),
        (["serve", "--tp", "2", "--ep-size", "3"], "--ep-size 3 must be 1"),
        (["serve", "--tp", "2", "--dp", "2", "--enable-dp-attention", "--disaggregation-mode", "prefill"],
         "--enable-dp-attention with --disaggregation-mode prefill is not supported"),
        (["serve", "--tp", "2", "--device", "cuda"], "needs 2 visible GPUs"),
        (["generate", "--tp", "2", "--prompt", "x"], "use `decode-server serve`"),
    ],
)
def test_tp_flags_are_validated(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from decode_server.cli import main

    if "cuda" in argv:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
            pytest.skip("this machine has 2 GPUs")
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_shared_pool_larger_than_dev_shm_is_a_clear_error(tmp_path: Path) -> None:
    from decode_server.hisparse.shared_host import _create_region, shm_free_bytes

    with pytest.raises(ValueError, match="--host-kv-budget"):
        _create_region(shm_free_bytes(tmp_path) + 2**30, tmp_path, "shared host KV pool")
    assert list(tmp_path.iterdir()) == []
