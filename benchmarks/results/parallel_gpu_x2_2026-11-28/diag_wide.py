# ruff: noqa  -- kept as it ran
"""Why the wide tiny-dsa's 2-GPU greedy tokens differ from one GPU's (test_tp_gpu / test_dp_gpu, 2026-11-28):
(a) are the ranks' random weights pieces of the one-GPU model on CUDA? (b) one GPU in bf16 (auto kernels and the
PyTorch reference kernels) and in float32 (reference kernels): where do their tokens part, by what float32 gap?
(c) TP=2 over NCCL against the same float32 run."""
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

sys.path[:0] = ["tests/parallel", "tests/hisparse"]
import torch

from decode_server.model import Tokenizer, build_random_model, load_config, resolve_model_path
from decode_server.model.construct import piece
from decode_server.parallel.layers import parameter_shards
from decode_server.parallel.state import ParallelState, destroy_parallel, init_parallel


def wide_config():
    from tp_gpu_workers import WIDE_TOP_K
    return dataclasses.replace(load_config("tiny-dsa"), num_attention_heads=64, num_key_value_heads=64,
                               index_topk=WIDE_TOP_K)


def single_run(dtype, backend):
    from harness import PAGE, run_script
    from tp_gpu_workers import WIDE_TOP_K, wide_arrivals

    from decode_server.config import EngineConfig, HiSparseConfig
    from decode_server.engine.engine import Engine
    config = wide_config()
    model = build_random_model(config, "cuda:0", dtype, seed=3)
    tok = Tokenizer.from_dir(resolve_model_path("tiny-dsa"))
    cfg = EngineConfig(
        device="cuda", enable_hisparse=False, page_size=PAGE, chunked_prefill_size=64,
        hisparse=HiSparseConfig(device_buffer_size=WIDE_TOP_K, num_recent_slots=2),
        device_kv_budget_bytes=64 << 20, max_running_requests=8, max_queued_requests=1024, disable_cuda_graph=True,
        disable_overlap_schedule=True, attention_backend=backend)
    engine = Engine(cfg, model=model, model_config=config, tokenizer=tok)
    res = run_script(engine, wide_arrivals())
    return {"tokens": res.tokens, "logits": {k: [x.float().cpu() for x in v] for k, v in res.logits.items()},
            "kernel": str(engine.attention_kernel)}


def tp_rank(rank, init_method, out_dir):
    from tp_gpu_workers import gpu_engine_runs
    device = torch.device("cuda", rank)
    tp = init_parallel(rank, 2, 1, init_method, device, timeout_s=180)
    try:
        r = gpu_engine_runs(tp, str(device), wide=True)
        ep = dataclasses.replace(tp, ep_size=2)
        r2 = gpu_engine_runs(ep, str(device), wide=True)
    finally:
        destroy_parallel(tp)
    torch.save({"tp": r, "ep": r2}, Path(out_dir) / f"rank{rank}.pt")


def main():
    out = {}
    # (a)
    config = wide_config()
    for dtype in (torch.bfloat16, torch.float32):
        full = build_random_model(config, "cuda:0", dtype, seed=3).state_dict()
        bad = []
        for ep in (1, 2):
            for rank in range(2):
                m = build_random_model(config, "cuda:0", dtype, seed=3, parallel=ParallelState(rank, 2, ep))
                shards = parameter_shards(m)
                for k, t in m.state_dict().items():
                    if not torch.equal(t, piece(full[k], shards.get(k))):
                        bad.append((ep, rank, k))
        print(f"(a) {dtype}: shard mismatches {len(bad)} {bad[:8]}", flush=True)
    # (b)
    runs = {}
    for name, dtype, backend in (("bf16-auto", torch.bfloat16, "auto"), ("bf16-ref", torch.bfloat16, "torch_native"),
                                 ("fp32-ref", torch.float32, "torch_native")):
        try:
            runs[name] = single_run(dtype, backend)
            print(f"(b) {name}: kernel {runs[name]['kernel']}", flush=True)
        except Exception as exc:  # noqa
            print(f"(b) {name} failed: {exc!r}", flush=True)
        torch.cuda.empty_cache()
    # (c)
    from tp_workers import run_ranks
    with tempfile.TemporaryDirectory() as d:
        ranks = run_ranks(tp_rank, Path(d), timeout_s=400)
    for mode in ("tp", "ep"):
        r = ranks[0][mode]["dense"]
        runs[f"{mode}2-bf16-auto"] = {"tokens": r["tokens"],
                                      "logits": {k: [x.float().cpu() for x in v] for k, v in r["logits"].items()}}
    ref = runs.get("fp32-ref")
    print("\n(b/c) tokens per request:")
    for name, r in runs.items():
        print(f"  {name:14s} " + " | ".join(f"{k}: {v}" for k, v in sorted(r["tokens"].items())))
    if ref:
        print("\nagainst fp32-ref: first differing token, fp32 gap there, max |logit - fp32| before it, logit std")
        for name, r in runs.items():
            for rid, toks in sorted(ref["tokens"].items()):
                other = r["tokens"][rid]
                first = next((i for i, (a, b) in enumerate(zip(toks, other)) if a != b), None)
                upto = first if first is not None else min(len(toks), len(other))
                dev = max((float((r["logits"][rid][i] - ref["logits"][rid][i]).abs().max()) for i in range(upto)),
                          default=0.0)
                std = float(ref["logits"][rid][0].std())
                gap = None
                if first is not None:
                    lf = ref["logits"][rid][first]
                    gap = float(lf[toks[first]] - lf[other[first]])
                print(f"  {name:14s} {rid}: first diff {first} fp32 gap {gap} max dev {dev:.3f} std {std:.2f}")
        # the one-GPU bf16-auto vs TP at their first difference, in fp32's logits and in their own
    a, b = runs.get("bf16-auto"), runs.get("tp2-bf16-auto")
    if a and b:
        for rid in sorted(a["tokens"]):
            first = next((i for i, (x, y) in enumerate(zip(a["tokens"][rid], b["tokens"][rid])) if x != y), None)
            if first is None:
                continue
            x, y = a["tokens"][rid][first], b["tokens"][rid][first]
            la, lb = a["logits"][rid][first], b["logits"][rid][first]
            top_a = torch.topk(la, 4)
            top_b = torch.topk(lb, 4)
            print(f"\n  {rid} token {first}: one GPU {x} (own gap {float(la[x]-la[y]):.3f}), TP {y} (own gap "
                  f"{float(lb[y]-lb[x]):.3f}); max |one - TP| {float((la-lb).abs().max()):.3f}; top4 one "
                  f"{top_a.indices.tolist()} {[round(v,2) for v in top_a.values.tolist()]}, TP {top_b.indices.tolist()} "
                  f"{[round(v,2) for v in top_b.values.tolist()]}")


if __name__ == "__main__":
    main()
