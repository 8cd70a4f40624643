"""`decode-server serve --tp-size 2 --dp-size 2 --enable-dp-attention` on CPU (gloo, tiny-dsa / tiny-glm5): real
servers, the openai client.

- greedy outputs of concurrent requests, spread over both ranks by the api, equal the single-rank engine's: dense
  (`--ep-size 2`), HiSparse (with swap-ins from each rank's own host pool) and tiny-glm5 (these two with overlap
  scheduling forced on);
- one request alone: the other rank runs idle passes (its MLP collectives) and nothing hangs;
- prefix caching (the tiny-glm5 server runs with `--enable-prefix-caching`): each rank has its own cache, a prompt
  sent again to the same rank reuses it, /flush_cache empties every rank's (the sum of what they dropped);
- capacity: with the same per-rank KV budgets, DP attention runs at least 1.9x the concurrent long requests of
  `--tp-size 2` (read from /metrics while requests wait), dense and HiSparse;
- aborted / disconnected requests free every rank's pools; a clean stop leaves no rank; killing rank 1 mid-stream
  ends the request with an error naming the rank, /health answers 503, the server exits non-zero, no rank is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from api_server_harness import (
    CONTEXT_LENGTH,
    ServerProcess,
    assert_clean_exit,
    flush_cache,
    pid_alive,
    wait_until_idle,
)
from prometheus_client.parser import text_string_to_metric_families

from decode_server.engine.llm import LLM
from decode_server.engine.sampling_params import SamplingParams

MODEL = "tiny-dsa"
DP2 = ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention")
PROMPTS = [" ".join(f"w{(i * 31 + j) % 97}" for j in range(24 + 3 * i)) for i in range(6)]
MAX_TOKENS = 10

# Capacity: long prompts on a per-rank KV budget of a few requests. tiny-dsa in float32: an MLA row is 2304 B and
# an indexer key 132 B, in each of 3 layers. Admission reserves a request's prompt + max_tokens (long prompts, so
# the estimate of future growth hardly matters): pages of 64 tokens, 8 per request.
CAPACITY_CONTEXT = 1024
LONG_PROMPT, LONG_MAX_TOKENS = 440, 60
NUM_LONG = 12
ROW, KEY, LAYERS, PAGE = 2304, 132, 3, 64
DENSE_BUDGET = 4 * 8 * PAGE * (ROW + KEY) * LAYERS  # 4 requests' pages per rank
# HiSparse: a host pool of 96 pages per rank; the device budget holds the indexer keys of all of them and the
# buffers (64 + 4 recent slots, every layer) of 3 requests: device buffers bind.
HISPARSE_CONFIG = '{"device_buffer_size": 64, "num_recent_slots": 4, "prefill_staging_tokens": 0}'
HOST_PAGES = 96
HOST_BUDGET = HOST_PAGES * PAGE * ROW * LAYERS
BUFFER_BYTES = (64 + 4) * ROW * LAYERS
HISPARSE_DEVICE_BUDGET = HOST_PAGES * PAGE * KEY * LAYERS + 3 * BUFFER_BYTES + BUFFER_BYTES // 2
DENSE_ARGS = ("--context-length", str(CAPACITY_CONTEXT), "--device-kv-budget", str(DENSE_BUDGET))
HISPARSE_ARGS = ("--context-length", str(CAPACITY_CONTEXT), "--enable-hisparse", "--hisparse-config",
                 HISPARSE_CONFIG, "--device-kv-budget", str(HISPARSE_DEVICE_BUDGET), "--host-kv-budget",
                 str(HOST_BUDGET))  # fmt: skip


def _start(*args: str) -> ServerProcess:
    return ServerProcess(*args)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerProcess]]:
    """Every server of this module, started at once (each loads the model in its ranks)."""
    started = {
        "dense_dp": _start(*DP2, "--ep-size", "2", *DENSE_ARGS),
        # overlap scheduling forced on (CUDA's default; off by default on CPU): each rank one pass ahead
        "hisparse_dp": _start(*DP2, *HISPARSE_ARGS, "--force-overlap-schedule"),
        "dense_tp": _start("--tp-size", "2", "--ep-size", "2", *DENSE_ARGS),
        "hisparse_tp": _start("--tp-size", "2", *HISPARSE_ARGS),
        "glm5_dp": _start("--model-path", "tiny-glm5", *DP2, "--ep-size", "2", "--enable-prefix-caching",
                          "--load-balance-method", "cache_aware", "--force-overlap-schedule"),
    }
    try:
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.kill()
            for pid in _rank_pids(server, quiet=True):
                if pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)


def _rank_pids(server: ServerProcess, quiet: bool = False) -> list[int]:
    try:
        info = httpx.get(server.url + "/server_info", timeout=10).json()["engine"]
    except (httpx.HTTPError, KeyError, ValueError):
        if quiet:
            return list(getattr(server, "_rank_pids", []))
        raise
    server._rank_pids = info["tp_rank_pids"]  # type: ignore[attr-defined]
    return server._rank_pids  # type: ignore[attr-defined]


def _completions(server: ServerProcess, prompts: list, model: str = MODEL, **kwargs: object) -> list:
    async def run_all() -> list:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        async with client:
            return await asyncio.gather(*(client.completions.create(model=model, prompt=p, **kwargs)
                                          for p in prompts))  # fmt: skip

    return asyncio.run(run_all())


def _greedy(server: ServerProcess, prompts: list, model: str = MODEL) -> list[str]:
    outs = _completions(server, prompts, model, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    return [o.choices[0].text for o in outs]


def _wait_idle_everywhere(server: ServerProcess) -> dict:
    """No request anywhere and every pool of every rank empty (a prefix cache's pages dropped first: they stay
    allocated)."""
    deadline = time.monotonic() + 30
    if wait_until_idle(server)["prefix_cache"] is not None:
        flush_cache(server)
    while True:
        stats = wait_until_idle(server)
        ranks = stats["dp_ranks"]
        used = [r[k]["used"] for r in ranks for k in ("host_pages", "device_slots", "indexer_slots", "dense_kv_slots")]
        if not any(used) and not any(r["num_running_reqs"] + r["num_queue_reqs"] for r in ranks):
            return stats
        assert time.monotonic() < deadline, ranks
        time.sleep(0.1)


@pytest.fixture(scope="module")
def tp1_outputs(offline_llm: LLM) -> list[str]:
    """The single-rank engine's greedy texts (dense; HiSparse equals dense, tests/hisparse)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = offline_llm.generate(PROMPTS, params)
    assert all(len(o.prompt_token_ids) + MAX_TOKENS > 64 for o in outs[3:]), "prompts too short to swap in"
    return [o.text for o in outs]


def test_server_info_reports_overlap_and_graphs(servers: dict[str, ServerProcess]) -> None:
    """/server_info says which servers run one pass ahead (forced on here; CUDA's default) and that CPU replays no
    decode graph. (First in the module: later tests stop and kill these servers.)"""
    expected = {"dense_dp": False, "hisparse_dp": True, "glm5_dp": True, "dense_tp": False, "hisparse_tp": False}
    for name, overlap in expected.items():
        info = httpx.get(servers[name].url + "/server_info", timeout=10).json()["engine"]
        assert info["overlap_schedule"] is overlap and info["cuda_graph_batch_sizes"] == [], (name, info)


def test_dense_dp_greedy_equals_tp1_over_both_ranks(servers, tp1_outputs) -> None:
    server = servers["dense_dp"]
    before = server.stats()["dp_ranks"]
    assert _greedy(server, PROMPTS) == tp1_outputs
    stats = _wait_idle_everywhere(server)
    generated = [r["num_generated_tokens"] - b["num_generated_tokens"] for r, b in zip(stats["dp_ranks"], before,
                                                                                        strict=True)]
    assert all(g > 0 for g in generated) and sum(generated) == len(PROMPTS) * MAX_TOKENS, generated  # both served
    info = httpx.get(server.url + "/server_info", timeout=10).json()
    engine = info["engine"]
    assert engine["enable_dp_attention"] and engine["dp_size"] == 2 and engine["ep_size"] == 2
    assert [r["dp_rank"] for r in engine["dp_ranks"]] == [0, 1] and not engine["host_pool_shared"]
    assert info["dp_inflight_requests"] == [0, 0]


def test_one_request_alone_leaves_the_other_rank_idle_not_stuck(servers, tp1_outputs) -> None:
    server = servers["dense_dp"]
    before = server.stats()["dp_ranks"]
    assert _greedy(server, PROMPTS[:1]) == tp1_outputs[:1]
    after = _wait_idle_everywhere(server)["dp_ranks"]
    served = [a["num_generated_tokens"] - b["num_generated_tokens"] for a, b in zip(after, before, strict=True)]
    idle = [a["num_idle_passes"] - b["num_idle_passes"] for a, b in zip(after, before, strict=True)]
    steps = [a["num_steps"] - b["num_steps"] for a, b in zip(after, before, strict=True)]
    busy = served.index(MAX_TOKENS)
    assert served[1 - busy] == 0 and idle[1 - busy] == steps[busy] > 0 and idle[busy] == 0, (served, idle, steps)


def test_unseeded_sampling_and_disconnects_free_every_rank(servers) -> None:
    server = servers["dense_dp"]
    outs = _completions(server, PROMPTS[:4], max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95,
                        extra_body={"ignore_eos": True})  # fmt: skip
    assert all(o.choices[0].finish_reason == "length" and o.usage.completion_tokens == MAX_TOKENS for o in outs)
    body = {"model": MODEL, "prompt": "Go on:", "max_tokens": 200, "ignore_eos": True, "temperature": 0.7,
            "stream": True}  # fmt: skip

    def disconnect_after_two_chunks() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: ")
                if chunks >= 2:
                    return  # closing the connection aborts the request

    threads = [threading.Thread(target=disconnect_after_two_chunks) for _ in range(4)]  # over both ranks
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    _wait_idle_everywhere(server)


def test_hisparse_dp_greedy_equals_tp1(servers, tp1_outputs) -> None:
    server = servers["hisparse_dp"]
    assert _greedy(server, PROMPTS) == tp1_outputs
    stats = _wait_idle_everywhere(server)
    assert sum(layer["misses"] for layer in stats["hisparse_layers"]) > 0  # rows came from the host pools
    assert all(r["num_generated_tokens"] > 0 for r in stats["dp_ranks"])
    assert all(r["host_pages"]["total"] == HOST_PAGES for r in stats["dp_ranks"])  # each rank its own pool


def test_glm5_dp_greedy_equals_tp1(servers) -> None:
    llm = LLM("tiny-glm5", device="cpu", context_length=CONTEXT_LENGTH)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    expected = [o.text for o in llm.generate(PROMPTS, params)]
    assert _greedy(servers["glm5_dp"], PROMPTS, "tiny-glm5") == expected
    stats = _wait_idle_everywhere(servers["glm5_dp"])
    assert all(r["num_generated_tokens"] > 0 for r in stats["dp_ranks"])


def test_glm5_dp_prefix_caching_per_rank(servers) -> None:
    """One request at a time goes to rank 0 (the least loaded, ties to the lower rank): the same prompt again finds
    its pages there. /flush_cache is a collective over the ranks: it answers with the sum of their dropped tokens,
    and every rank's pools are empty after it."""
    server = servers["glm5_dp"]
    prompt = [(7 * i) % 1000 + 5 for i in range(140)]
    outs = [_completions(server, [prompt], "tiny-glm5", max_tokens=MAX_TOKENS, temperature=0,
                         extra_body={"ignore_eos": True})[0] for _ in range(2)]  # fmt: skip
    assert [o.usage.prompt_tokens_details.cached_tokens for o in outs] == [0, 128]
    assert outs[0].choices[0].text == outs[1].choices[0].text
    # concurrent prompts of their own spread over both ranks: each rank caches theirs
    _completions(server, [[(11 * i + 97 * k) % 1000 + 5 for i in range(130)] for k in range(4)], "tiny-glm5",
                 max_tokens=2, temperature=0)
    stats = wait_until_idle(server)
    cache = stats["prefix_cache"]
    assert cache["hit_tokens"] >= 128 and cache["cached_tokens"] == cache["evictable_tokens"] >= 128 + 4 * 128
    assert all(r["dense_kv_slots"]["used"] >= 128 for r in stats["dp_ranks"]), stats["dp_ranks"]
    assert flush_cache(server) == {"prefix_caching": True, "dropped_tokens": cache["cached_tokens"]}
    stats = _wait_idle_everywhere(server)
    assert stats["prefix_cache"]["cached_tokens"] == 0
    assert stats["prefix_cache"]["evicted_tokens"] == cache["evicted_tokens"] + cache["cached_tokens"]


def test_glm5_dp_cache_aware_sends_a_prompt_to_the_rank_that_cached_its_start(servers) -> None:
    """`--load-balance-method cache_aware`: two system prompts in flight at once land on the two ranks; later
    prompts that start with either go to its rank and reuse its pages, where the shortest queue (ranks idle: rank 0)
    would have recomputed one of them."""
    server = servers["glm5_dp"]
    flush_cache(server)
    _wait_idle_everywhere(server)
    system = [[(17 * i + 101 * k) % 1000 + 5 for i in range(150)] for k in range(2)]
    first = _completions(server, [system[0] + [7, 8], system[1] + [9]], "tiny-glm5", max_tokens=MAX_TOKENS,
                         temperature=0)  # fmt: skip
    assert [o.usage.prompt_tokens_details.cached_tokens for o in first] == [0, 0]
    stats = wait_until_idle(server)
    assert all(r["dense_kv_slots"]["used"] >= 128 for r in stats["dp_ranks"]), "one system prompt on each rank"
    # One at a time, ranks idle: the shortest queue would send both to rank 0, where only one of them is cached.
    again = [_completions(server, [system[k] + [11, 12]], "tiny-glm5", max_tokens=MAX_TOKENS, temperature=0)[0]
             for k in range(2)]
    assert [o.usage.prompt_tokens_details.cached_tokens for o in again] == [128, 128]
    decisions = httpx.get(server.url + "/server_info", timeout=10).json()["dp_cache_aware_decisions"]
    assert decisions["hit"] >= 2 and decisions["miss"] >= 2, decisions
    _wait_idle_everywhere(server)


def _gauges(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            rank = sample.labels.get("dp_rank")
            out[sample.name + (f"[{rank}]" if rank is not None else "")] = sample.value
    return out


def _most_running(server: ServerProcess) -> tuple[int, dict]:
    """Send NUM_LONG long requests at once and read /metrics while some still wait: the most requests running at
    once (it stays there for a while: requests end only after their 60 tokens), then abort them all."""
    prompts = [[(13 * i + 7 * j) % 1000 + 5 for j in range(LONG_PROMPT)] for i in range(NUM_LONG)]
    done = threading.Event()

    def send() -> None:
        try:
            _completions(server, prompts, max_tokens=LONG_MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        except openai.OpenAIError:
            pass  # aborted below
        finally:
            done.set()

    sender = threading.Thread(target=send)
    sender.start()
    most, at_most, stable_since = 0, {}, time.monotonic()
    deadline = time.monotonic() + 120
    while not done.is_set() and time.monotonic() < deadline:
        gauges = _gauges(server)
        running, queued = int(gauges["sglang:num_running_reqs"]), int(gauges["sglang:num_queue_reqs"])
        if running > most:
            most, at_most, stable_since = running, gauges, time.monotonic()
        if queued > 0 and most > 0 and time.monotonic() - stable_since > 1.5:
            break  # the running set has stayed at its most for a while with requests still waiting
        time.sleep(0.05)
    httpx.post(server.url + "/abort_request", json={"abort_all": True}, timeout=10)
    sender.join(60)
    return most, at_most


def test_capacity_dense_dp_admits_twice_tp(servers) -> None:
    dp, dp_gauges = _most_running(servers["dense_dp"])
    tp, _ = _most_running(servers["dense_tp"])
    assert tp >= 2 and dp >= 1.9 * tp, (dp, tp)
    # the DP server's requests ran on both ranks, each rank's KV holding its own
    per_rank = [dp_gauges[f"hisparse:dp_num_running_reqs[{r}]"] for r in (0, 1)]
    assert min(per_rank) >= 1.9 * tp / 2, per_rank
    for server in (servers["dense_dp"], servers["dense_tp"]):
        wait_until_idle(server)


def test_capacity_hisparse_dp_admits_twice_tp(servers) -> None:
    dp, dp_gauges = _most_running(servers["hisparse_dp"])
    tp, _ = _most_running(servers["hisparse_tp"])
    assert tp == 3 and dp >= 1.9 * tp, (dp, tp)  # three device buffers per rank bind
    assert [dp_gauges[f"hisparse:dp_device_buffer_used_slots[{r}]"] > 0 for r in (0, 1)] == [True, True]
    for server in (servers["hisparse_dp"], servers["hisparse_tp"]):
        wait_until_idle(server)


def test_clean_stop_leaves_no_rank(servers) -> None:
    server = servers["glm5_dp"]
    pids = _rank_pids(server)
    code = server.stop(signal.SIGTERM)
    assert_clean_exit(server, code)
    _assert_gone(pids)


def _assert_gone(pids: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if pid_alive(p)], f"rank processes {pids} outlived the server"


def test_killing_rank1_ends_the_server_cleanly(servers) -> None:
    server = servers["dense_dp"]
    pids = _rank_pids(server)
    body = {"model": MODEL, "prompt": "Go on:", "max_tokens": 200, "ignore_eos": True, "temperature": 0,
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
    assert error["type"] == "engine_unavailable" and "data-parallel attention rank 1" in error["message"], error
    try:
        health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]
    except httpx.TransportError:
        pass  # already exited: not hanging either
    assert server.proc.wait(30) != 0
    _assert_gone(pids + server.children)
    assert "data-parallel attention rank 1" in server.log_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--tp", "4", "--dp", "2", "--enable-dp-attention"], "attention tensor parallelism inside a DP"),
        (["serve", "--tp", "2", "--dp", "2"], "without --enable-dp-attention"),
        (["serve", "--tp", "2", "--enable-dp-attention"], "needs --dp-size N > 1"),
        (["serve", "--tp", "3", "--dp", "2", "--enable-dp-attention"], "must divide --tp-size 3"),
        (["serve", "--tp", "2", "--dp", "2", "--enable-dp-attention", "--ep-size", "3"], "--ep-size 3 must be 1"),
        (["serve", "--enable-dp-lm-head"], "--enable-dp-lm-head needs --enable-dp-attention"),
        (["serve", "--tp", "2", "--dp", "2", "--enable-dp-attention", "--disaggregation-mode", "prefill"],
         "with --disaggregation-mode prefill is not supported"),
        (["generate", "--tp", "2", "--dp", "2", "--enable-dp-attention", "--prompt", "x"], "use `decode-server serve`"),
    ],
)
def test_dp_flags_are_validated(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from decode_server.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err

