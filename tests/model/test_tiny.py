"""tiny-dsa: deterministic atomic generation, loadability, deterministic non-degenerate generation, and long
prompts prefilling within a stated memory bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dsa_test_helpers import dense_backend, greedy_generate

from decode_server.model import Tokenizer, load_model, resolve_model_path
from decode_server.model.tiny import TINY_NAME

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# Memory bound for one prefill pass of S tokens on CPU (float32): peak RSS growth <= FIXED + PER_TOKEN * S.
# Per token the model keeps the absorbed query (16·576 fp32 = 36 KiB), the latent output (32 KiB) and the cache
# rows; the backend adds chunk buffers. A quadratic S×S fp32 score matrix alone would be 1 GiB at 16K tokens
# and S×S×576 would be 576 GiB; measured growth: ~0.8 GiB at 4K tokens and ~1.8 GiB at 16K in one pass (docs/model.md).
BOUND_FIXED_BYTES = 768 << 20
BOUND_PER_TOKEN_BYTES = 160 << 10


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hisparse_cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("HISPARSE_CACHE_DIR", str(cache))
    yield cache
    mp.undo()


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_generation_is_deterministic(tmp_path, monkeypatch) -> None:
    copies = []
    for name in ("a", "b"):
        monkeypatch.setenv("HISPARSE_CACHE_DIR", str(tmp_path / name))
        copies.append(_files(resolve_model_path(TINY_NAME)))
    assert copies[0].keys() >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert copies[0] == copies[1]


def test_concurrent_generation_is_atomic(tmp_path) -> None:
    """Several processes asking at once all get the same complete checkpoint; no staging dirs remain."""
    env = {**os.environ, "HISPARSE_CACHE_DIR": str(tmp_path)}
    code = "from decode_server.model import resolve_model_path; print(resolve_model_path('tiny-dsa'))"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(outputs) == 1
    assert [p.name for p in tmp_path.iterdir()] == [Path(outputs.pop()).name]


def test_checkpoint_has_fp8_weights_and_chat_template(cache_env) -> None:
    from safetensors import safe_open

    path = resolve_model_path(TINY_NAME)
    with safe_open(str(path / "model.safetensors"), "pt") as fh:
        dtypes = {fh.get_slice(n).get_dtype() for n in fh.keys()}  # noqa: SIM118
        assert "model.layers.1.self_attn.q_b_proj.weight_scale_inv" in fh.keys()  # noqa: SIM118
    assert {"F8_E4M3", "BF16", "F32"} <= dtypes
    config = json.loads((path / "config.json").read_text())
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["index_head_dim"]) == (512, 64, 128)
    tok = Tokenizer.from_dir(path)
    assert tok.vocab_size == config["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id) == (config["bos_token_id"], config["eos_token_id"])
    text = "Hello, sparse attention! 123"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == text
    prompt = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Hi"}])
    assert prompt == "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜>"
    assert tok.encode(prompt, add_special_tokens=False)[0] == tok.bos_token_id


def test_greedy_generation_is_deterministic_and_prompt_dependent(cache_env) -> None:
    model, config = load_model(TINY_NAME, "cpu", torch.float32)
    tok = Tokenizer.from_dir(resolve_model_path(TINY_NAME))
    prompts = ["The quick brown fox", "Once upon a time", "def fibonacci(n):", "What is the capital of France?"]
    runs = []
    for _ in range(2):
        backend = dense_backend(config)
        runs.append([greedy_generate(model, backend, tok.encode(p), steps=8) for p in prompts])
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[0]}) == len(prompts)  # different prompts → different continuations
    assert all(len(set(r)) > 1 for r in runs[0])  # not one token repeated


def _probe(length: int, chunk: int | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)])}
    args = [sys.executable, str(HERE / "long_prefill_probe.py"), str(length)] + ([str(chunk)] if chunk else [])
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check_bound(result: dict) -> None:
    bound = BOUND_FIXED_BYTES + BOUND_PER_TOKEN_BYTES * result["chunk"]
    print(f"prefill {result['tokens']} tokens (chunk {result['chunk']}): {result['seconds']:.1f} s, "
          f"peak RSS growth {result['growth_bytes'] / 2**20:.0f} MiB (bound {bound / 2**20:.0f} MiB)")
    assert result["finite"]
    assert result["growth_bytes"] <= bound


def test_long_prompt_prefill_memory_bound(cache_env) -> None:
    resolve_model_path(TINY_NAME)  # generate once, outside the measured process
    _check_bound(_probe(4096))


# The 16K runs take 2-3 minutes on 2 CPU cores: the reference indexer scores every query against its whole
# prefix (~0.8 TFLOP over 3 layers), which is quadratic work however little memory it uses.
@pytest.mark.slow
@pytest.mark.parametrize("chunk", [None, 2048], ids=["single_pass", "chunks_of_2048"])
def test_16k_prompt_memory_bound(cache_env, chunk: int | None) -> None:
    resolve_model_path(TINY_NAME)
    _check_bound(_probe(16384, chunk))
