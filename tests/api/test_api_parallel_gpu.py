"""`decode-server serve --tp-size 2` on 2 GPUs (NCCL): real servers, the openai client, on tiny-dsa widened to the
GPU kernels' shapes (64 heads, 32 a rank; top-k 128), written to a checkpoint directory with random weights.

TP (HiSparse) and DP attention (dense, `--ep-size 2`) servers capture decode CUDA graphs and run overlap scheduling
on every rank; concurrent requests complete, the TP ranks agree (token digests), and a SIGTERM stops the server
cleanly: exit 0 within the test's limit and no rank left. The stop is the point: a rank must destroy its graphs
before leaving the NCCL group, or `destroy_process_group` waits forever (it did, on 2 H200s, before
`Engine.close()`).

Run: pytest -m gpu tests/api/test_api_parallel_gpu.py -v
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from api_server_harness import ServerProcess, assert_clean_exit, pid_alive

from decode_server.model import build_random_model, resolve_model_path
from decode_server.model.checkpoint_writer import checkpoint_tensors, save_checkpoint
from decode_server.model.config import ModelConfig

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs (NCCL)", allow_module_level=True)

PROMPTS = [" ".join(f"w{(i * 31 + j) % 97}" for j in range(30 + 6 * i)) for i in range(6)]
MAX_TOKENS = 12
STOP_TIMEOUT_S = 60.0
START_TIMEOUT_S = 420.0
MODEL_NAME = "wide-dsa"


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> Path:
    """tiny-dsa's tokenizer and config with 64 heads and top-k 128, random weights (what tests/parallel's GPU
    workers build in-process), as a checkpoint the server loads."""
    tiny = resolve_model_path("tiny-dsa")
    raw = json.loads((tiny / "config.json").read_text())
    raw.pop("quantization_config", None)  # bf16 weights: the FP8 path is not what this test is about
    raw.update(num_attention_heads=64, num_key_value_heads=64, index_topk=128)
    config = ModelConfig.from_dict(raw)
    out = tmp_path_factory.mktemp("wide-dsa")
    model = build_random_model(config, "cpu", torch.float32, seed=3)
    save_checkpoint(checkpoint_tensors(model), raw, out)
    for file in tiny.iterdir():
        if file.name.startswith(("tokenizer", "generation_config")):
            shutil.copy(file, out / file.name)
    return out


async def _complete_all(url: str) -> list[openai.types.Completion]:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
        return await asyncio.gather(*(
            client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0.0,
                                      extra_body={"ignore_eos": True})
            for p in PROMPTS
        ))


@pytest.mark.parametrize("args", [
    ("--tp-size", "2", "--enable-hisparse", "--hisparse-config", '{"device_buffer_size": 128, "num_recent_slots": 4}'),
    ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--ep-size", "2"),
], ids=["tp2-hisparse", "dp2-ep2"])
def test_graphs_on_every_rank_and_a_clean_stop(wide_model: Path, args: tuple[str, ...]) -> None:
    # Small KV budgets: pinning the default host pool (half the host's memory) alone takes minutes. A cold kernel
    # cache compiles the Triton kernels on both ranks during start-up: hence the longer start limit.
    server = ServerProcess("--model-path", str(wide_model), "--device", "cuda", "--quantization", "none",
                           "--device-kv-budget", "2GiB", "--host-kv-budget", "2GiB", "--cuda-graph-max-bs", "8",
                           "--served-model-name", MODEL_NAME, *args).wait_ready(timeout=START_TIMEOUT_S)
    try:
        engine = httpx.get(server.url + "/server_info", timeout=10).json()["engine"]
        assert engine["overlap_schedule"] is True, engine
        assert engine["cuda_graph_batch_sizes"], f"no CUDA graphs captured: {engine}"
        pids = engine["tp_rank_pids"]
        assert len(pids) == 2 and pids[0] == server.engine_pid
        outputs = asyncio.run(_complete_all(server.url))
        assert [o.usage.completion_tokens for o in outputs] == [MAX_TOKENS] * len(PROMPTS)
        stats = server.stats()
        if "--enable-dp-attention" not in args:
            ranks = stats["tp_ranks"]
            assert ranks[0]["token_digest"] == ranks[1]["token_digest"], ranks
        started = time.monotonic()
        code = server.stop(signal.SIGTERM, timeout=STOP_TIMEOUT_S)
        assert_clean_exit(server, code)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
            time.sleep(0.1)
        assert not [p for p in pids if pid_alive(p)], f"rank processes {pids} outlived the server"
        assert time.monotonic() - started < STOP_TIMEOUT_S
    finally:
        server.kill()
