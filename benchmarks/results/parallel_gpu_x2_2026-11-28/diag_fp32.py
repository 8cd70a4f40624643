# ruff: noqa  -- kept as it ran
"""The 2-GPU wide tiny-dsa runs in float32 (PyTorch reference attention) against one GPU in float32: if TP / EP /
DP compute the same model, their tokens agree and their logits differ by float32 rounding only; the bf16 runs
with the reference attention too, to see whether bf16 alone (not the GPU kernels) parts them."""
import dataclasses
import sys
import tempfile
from pathlib import Path

sys.path[:0] = ["tests/parallel", "tests/hisparse"]
import torch

from decode_server.model import Tokenizer, build_random_model, load_config, resolve_model_path
from decode_server.parallel.state import destroy_parallel, init_parallel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def wide_config():
    from tp_gpu_workers import WIDE_TOP_K
    return dataclasses.replace(load_config("tiny-dsa"), num_attention_heads=64, num_key_value_heads=64,
                               index_topk=WIDE_TOP_K)


def tp_style_run(parallel, device, dtype, arrivals, hisparse=False):
    from harness import PAGE, run_script
    from tp_gpu_workers import WIDE_TOP_K

    from decode_server.config import EngineConfig, HiSparseConfig
    from decode_server.engine.engine import Engine
    config = wide_config()
    model = build_random_model(config, device, dtype, seed=3, parallel=parallel)
    tok = Tokenizer.from_dir(resolve_model_path("tiny-dsa"))
    cfg = EngineConfig(
        device="cuda", enable_hisparse=hisparse, page_size=PAGE, chunked_prefill_size=64,
        hisparse=HiSparseConfig(device_buffer_size=WIDE_TOP_K, num_recent_slots=2),
        device_kv_budget_bytes=64 << 20, max_running_requests=8, max_queued_requests=1024, disable_cuda_graph=True,
        disable_overlap_schedule=True, attention_backend="torch_native",
        tp_size=parallel.tp_size if parallel is not None else 1, ep_size=parallel.ep_size if parallel else 1)
    engine = Engine(cfg, model=model, model_config=config, tokenizer=tok, parallel=parallel)
    res = run_script(engine, arrivals)
    out = {"tokens": res.tokens, "logits": {k: [x.float().cpu() for x in v] for k, v in res.logits.items()}}
    del engine, model
    torch.cuda.empty_cache()
    return out


def dp_style_run(parallel, device, dtype, rank):
    from dp_workers import engine_config, gpu_rank_arrivals, run_engine
    from tp_gpu_workers import WIDE_TOP_K

    from decode_server.config import HiSparseConfig
    from decode_server.engine.engine import Engine
    config = wide_config()
    model = build_random_model(config, device, dtype, seed=3, parallel=parallel)
    tok = Tokenizer.from_dir(resolve_model_path("tiny-dsa"))
    cfg = engine_config(False, parallel).model_copy(update={
        "device": "cuda", "disable_cuda_graph": True, "disable_overlap_schedule": True,
        "attention_backend": "torch_native",
        "hisparse": HiSparseConfig(device_buffer_size=WIDE_TOP_K, num_recent_slots=2)})
    engine = Engine(cfg, model=model, model_config=config, tokenizer=tok, parallel=parallel)
    r = run_engine(engine, gpu_rank_arrivals(rank, True), parallel)
    out = {"tokens": r["tokens"], "logits": {k: [x.float().cpu() for x in v] for k, v in r["logits"].items()}}
    del engine, model
    torch.cuda.empty_cache()
    return out


def tp_ranks(rank, init_method, out_dir):
    from tp_gpu_workers import wide_arrivals
    device = torch.device("cuda", rank)
    tp = init_parallel(rank, 2, 1, init_method, device, timeout_s=180)
    ep = dataclasses.replace(tp, ep_size=2)
    res = {}
    try:
        for name, dtype in DTYPES.items():
            res[f"tp-{name}"] = tp_style_run(tp, str(device), dtype, wide_arrivals())
            res[f"ep-{name}"] = tp_style_run(ep, str(device), dtype, wide_arrivals())
    finally:
        destroy_parallel(tp)
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


def dp_ranks(rank, init_method, out_dir):
    device = torch.device("cuda", rank)
    dp = init_parallel(rank, 2, 2, init_method, device, timeout_s=180, dp_size=2)
    res = {}
    try:
        for name, dtype in DTYPES.items():
            res[f"dp-{name}"] = dp_style_run(dp, str(device), dtype, rank)
    finally:
        destroy_parallel(dp)
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


def compare(label, ref, other):
    for rid in sorted(ref["tokens"]):
        a, b = ref["tokens"][rid], other["tokens"][rid]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        upto = first if first is not None else min(len(a), len(b))
        dev = max((float((other["logits"][rid][i] - ref["logits"][rid][i]).abs().max()) for i in range(upto)),
                  default=0.0)
        extra = ""
        if first is not None:
            lr, lo = ref["logits"][rid][first], other["logits"][rid][first]
            extra = (f"; there ref gap {float(lr[a[first]] - lr[b[first]]):.3f}, own gap "
                     f"{float(lo[b[first]] - lo[a[first]]):.3f}, max |diff| {float((lr - lo).abs().max()):.3f}")
        print(f"  {label:28s} {rid}: {'same tokens' if first is None else f'first diff at {first}'}, "
              f"max |logit diff| before {dev:.2e}{extra}")


def main():
    from dp_workers import gpu_rank_arrivals
    from tp_gpu_workers import wide_arrivals
    from tp_workers import run_ranks
    single = {name: tp_style_run(None, "cuda:0", dtype, wide_arrivals()) for name, dtype in DTYPES.items()}
    single_dp = {name: tp_style_run(None, "cuda:0", dtype, gpu_rank_arrivals(0, True)) for name, dtype in DTYPES.items()}
    with tempfile.TemporaryDirectory() as d:
        tp = run_ranks(tp_ranks, Path(d), timeout_s=400)
    with tempfile.TemporaryDirectory() as d:
        dp = run_ranks(dp_ranks, Path(d), timeout_s=400)
    print("\nagainst one GPU, same dtype, PyTorch reference attention:")
    for name in DTYPES:
        compare(f"one GPU {name} vs fp32", single["fp32"], single[name])
        for mode in ("tp", "ep"):
            compare(f"{mode}=2 rank0 {name}", single[name], tp[0][f"{mode}-{name}"])
            compare(f"{mode}=2 rank1 == rank0 {name}", tp[0][f"{mode}-{name}"], tp[1][f"{mode}-{name}"])
        compare(f"dp=2 rank0 {name}", single_dp[name], dp[0][f"dp-{name}"])
        compare(f"dp one GPU {name} vs fp32", single_dp["fp32"], single_dp[name])
    print("\ntokens:")
    for label, r in [("one fp32", single["fp32"]), ("one bf16", single["bf16"]), ("tp fp32", tp[0]["tp-fp32"]),
                     ("tp bf16", tp[0]["tp-bf16"]), ("ep fp32", tp[0]["ep-fp32"]), ("ep bf16", tp[0]["ep-bf16"]),
                     ("dp1 fp32", single_dp["fp32"]), ("dp fp32", dp[0]["dp-fp32"]), ("dp bf16", dp[0]["dp-bf16"])]:
        print(f"  {label:10s} " + " | ".join(f"{k}: {v}" for k, v in sorted(r["tokens"].items())))


if __name__ == "__main__":
    main()
