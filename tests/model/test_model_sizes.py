"""Any valid MLA / indexer size runs on the reference (CPU) path; the GPU kernels' limits are refused at load.

The sizes are issue 15's: a valid deepseek_v32 config with kv_lora_rank 256, qk_rope_head_dim 32,
qk_nope_head_dim 64, v_head_dim 96 and index_head_dim 64 (rows of 288 values, not 576).
"""

from __future__ import annotations

import pytest
import torch
from dsa_test_helpers import ListBackend, prefill_logits, small_config_dict, small_model
from test_mla import naive_mla

from decode_server.config import EngineConfig, HiSparseConfig
from decode_server.engine.engine import Engine
from decode_server.engine.forward_batch import ForwardBatch
from decode_server.engine.forward_context import forward_context
from decode_server.engine.kernel_support import check_kernel_support, gpu_kernel_problems
from decode_server.engine.sampling_params import SamplingParams
from decode_server.model import ModelConfig, load_config

ODD = {"kv_lora_rank": 256, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 96,
       "index_head_dim": 64}
CUDA = torch.device("cuda")


def test_absorbed_mla_equals_naive_with_odd_sizes() -> None:
    """float64: the absorbed form over the indexer's selection = textbook MLA with expanded K/V (288-wide rows)."""
    model = small_model(torch.float64, index_topk=8, **ODD)
    torch.manual_seed(3)
    x = torch.randn(30, model.config.hidden_size, dtype=torch.float64)
    positions = torch.arange(30)
    attn = model.model.layers[0].self_attn
    cos, sin = model.model.rotary(positions, x.dtype)
    backend = ListBackend(d_v=256)
    with forward_context(ForwardBatch.build([0], [0], [30], "cpu"), backend):
        got = attn(x, cos, sin, cos.float(), sin.float())
    assert backend.kv[(0, 0)].shape == (30, 288) and backend.keys[(0, 0)].shape == (30, 64)
    (_, topk), = backend.topk_log
    assert (topk[8:] >= 0).all() and (topk[:8] == -1).any()
    want = naive_mla(attn, x, cos, sin, [row[row >= 0].long() for row in topk])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def _engine(model, hisparse: bool, kv_cache_dtype: str = "auto") -> Engine:
    cfg = EngineConfig(device="cpu", enable_hisparse=hisparse, page_size=16, chunked_prefill_size=32,
                       device_kv_budget_bytes=8 << 20, kv_cache_dtype=kv_cache_dtype,
                       hisparse=HiSparseConfig(device_buffer_size=16, num_recent_slots=2))
    return Engine(cfg, model=model, model_config=model.config, tokenizer=None)


def _generate(engine: Engine, prompts: list[list[int]], max_tokens: int):
    logits: dict[str, list[torch.Tensor]] = {}
    engine.logits_hook = lambda rids, lg: [logits.setdefault(r, []).append(lg[i].clone())
                                           for i, r in enumerate(rids)]
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.setdefault(delta.rid, []).extend(delta.new_token_ids)
    assert engine.is_idle_and_empty()
    return tokens, logits


def test_engine_generates_odd_sizes_hisparse_identical_to_dense() -> None:
    """Prompts past index_topk (16) so the indexer, swap-in and chunked prefill all run at 288-wide rows."""
    model = small_model(torch.float32, seed=5, index_topk=16, **ODD)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 97, (n,), generator=gen).tolist() for n in (40, 57, 23)]
    dense_tokens, dense_logits = _generate(_engine(model, hisparse=False), prompts, 12)
    hs_engine = _engine(model, hisparse=True)
    assert hs_engine.kv.buffers.kv.shape[-1] == 288 * 4 and hs_engine.kv.indexer.keys.shape[-1] == 64
    hs_tokens, hs_logits = _generate(hs_engine, prompts, 12)
    assert dense_tokens == hs_tokens and all(len(t) == 12 for t in dense_tokens.values())
    for rid, steps in dense_logits.items():
        for a, b in zip(steps, hs_logits[rid], strict=True):
            assert torch.equal(a, b)
    # The engine's prefill logits equal the literal per-query reference backend's.
    reference = prefill_logits(model, ListBackend(d_v=256), prompts[0])[-1]
    torch.testing.assert_close(dense_logits["r0"][0], reference, rtol=1e-4, atol=1e-4)


def test_fp8_kv_with_odd_sizes_is_refused_at_load() -> None:
    model = small_model(torch.float32, **ODD)
    with pytest.raises(ValueError, match=r"fp8_e4m3 .*kv_lora_rank 256 and qk_rope_head_dim 32"):
        _engine(model, hisparse=False, kv_cache_dtype="fp8_e4m3")


def test_cuda_refuses_sizes_the_gpu_kernels_lack() -> None:
    """The load-time check with CUDA semantics (runs on CPU): every field named with its value and support."""
    odd = ModelConfig.from_dict(small_config_dict(index_topk=100, num_attention_heads=8, **ODD))
    with pytest.raises(ValueError) as err:
        check_kernel_support(odd, CUDA, torch.bfloat16, "auto")
    message = str(err.value)
    for text in ("kv_lora_rank = 256 (supported: 512)", "qk_rope_head_dim = 32 (supported: 64)",
                 "index_head_dim = 64 (supported: 128)", "index_topk = 100 (supported: a positive multiple of 64)",
                 "num_attention_heads = 8", "--attention-backend torch_native"):
        assert text in message
    assert "dtype = float32" in "; ".join(gpu_kernel_problems(load_config("tiny-dsa"), torch.float32))
    # Asked-for reference kernels, and CPU, run any size.
    check_kernel_support(odd, CUDA, torch.bfloat16, "torch_native")
    check_kernel_support(odd, torch.device("cpu"), torch.float32, "auto")


@pytest.mark.parametrize("name", ["tiny-dsa", "deepseek-v3.2", "dsv32-bench", "dsv32-bench-16l"])
def test_real_checkpoint_sizes_pass_the_gpu_check(name: str) -> None:
    assert gpu_kernel_problems(load_config(name), torch.bfloat16) == []


def test_cli_attention_backend_flag() -> None:
    from decode_server.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["generate", "--attention-backend", "torch_native", "--prompt", "x"])
    assert engine_config_from_args(args).attention_backend == "torch_native"


def test_cuda_head_check_counts_heads_per_tensor_parallel_rank() -> None:
    """With TP a rank's kernels see num_attention_heads / tp_size heads: tiny-dsa's 16 heads run as one block at
    TP=1 but as 8 per rank at TP=2, which the GPU kernels do not take; 128 heads (DeepSeek-V3.2) at TP=8 are 16."""
    tiny = load_config("tiny-dsa")
    assert not gpu_kernel_problems(tiny, torch.bfloat16)
    assert any("num_attention_heads / tp_size 2" in p for p in gpu_kernel_problems(tiny, torch.bfloat16, 2))
    with pytest.raises(ValueError, match=r"num_attention_heads / tp_size 2 = 8"):
        check_kernel_support(tiny, CUDA, torch.bfloat16, "auto", tp_size=2)
    assert not gpu_kernel_problems(load_config("deepseek-v3.2"), torch.bfloat16, 8)
