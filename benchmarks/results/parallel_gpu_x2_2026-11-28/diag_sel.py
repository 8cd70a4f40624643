# ruff: noqa  -- kept as it ran
"""Wide tiny-dsa, bf16, one GPU against TP=2: which of the two things `--attention-backend torch_native` switches
(the indexer top-k's reference and the attention's reference) parts their tokens, and how their indexer
selections differ (recorded per layer, request row and position)."""
import dataclasses
import sys
import tempfile
from pathlib import Path

sys.path[:0] = ["tests/parallel", "tests/hisparse"]
import torch

import decode_server.engine.dense_backend as db
from decode_server.model import Tokenizer, build_random_model, load_config, resolve_model_path
from decode_server.parallel.state import destroy_parallel, init_parallel

MODES = {  # name: (attention_backend, indexer reference forced or None)
    "auto": ("auto", None),
    "auto+ref-indexer": ("auto", True),
    "ref-attn+fast-indexer": ("torch_native", False),
    "ref": ("torch_native", None),
}
REC: dict = {}
_orig_topk = db.indexer_topk
_orig_method = db.DenseBackend.index_topk


def patch(indexer_ref):
    def topk(*a, **k):
        a = list(a)
        if indexer_ref is not None:
            a[8] = indexer_ref
        return _orig_topk(*a, **k)
    db.indexer_topk = topk

    def method(self, layer_id, q, weights, top_k):
        out = _orig_method(self, layer_id, q, weights, top_k)
        batch, _, _ = self._current()
        rows, tr, pos = batch.req_rows_cpu, batch.token_req.tolist(), batch.positions.tolist()
        o = out.cpu().tolist()
        for t in range(len(pos)):
            REC[(layer_id, rows[tr[t]], pos[t])] = frozenset(x for x in o[t] if x >= 0)
        return out
    db.DenseBackend.index_topk = method


def run(parallel, device, mode):
    from harness import PAGE, run_script
    from tp_gpu_workers import WIDE_TOP_K, wide_arrivals

    from decode_server.config import EngineConfig, HiSparseConfig
    from decode_server.engine.engine import Engine
    backend, indexer_ref = MODES[mode]
    patch(indexer_ref)
    REC.clear()
    config = dataclasses.replace(load_config("tiny-dsa"), num_attention_heads=64, num_key_value_heads=64,
                                 index_topk=WIDE_TOP_K)
    model = build_random_model(config, device, torch.bfloat16, seed=3, parallel=parallel)
    tok = Tokenizer.from_dir(resolve_model_path("tiny-dsa"))
    cfg = EngineConfig(
        device="cuda", enable_hisparse=False, page_size=PAGE, chunked_prefill_size=64,
        hisparse=HiSparseConfig(device_buffer_size=WIDE_TOP_K, num_recent_slots=2),
        device_kv_budget_bytes=64 << 20, max_running_requests=8, max_queued_requests=1024, disable_cuda_graph=True,
        disable_overlap_schedule=True, attention_backend=backend,
        tp_size=parallel.tp_size if parallel is not None else 1, ep_size=parallel.ep_size if parallel else 1)
    engine = Engine(cfg, model=model, model_config=config, tokenizer=tok, parallel=parallel)
    res = run_script(engine, wide_arrivals())
    out = {"tokens": res.tokens, "logits": {k: [x.float().cpu() for x in v] for k, v in res.logits.items()},
           "sel": dict(REC), "kernel": engine.attention_kernel}
    del engine, model
    torch.cuda.empty_cache()
    return out


def tp_ranks(rank, init_method, out_dir):
    device = torch.device("cuda", rank)
    tp = init_parallel(rank, 2, 1, init_method, device, timeout_s=180)
    try:
        res = {mode: run(tp, str(device), mode) for mode in MODES}
    finally:
        destroy_parallel(tp)
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


def main():
    from tp_workers import run_ranks
    one = {mode: run(None, "cuda:0", mode) for mode in MODES}
    with tempfile.TemporaryDirectory() as d:
        tp = run_ranks(tp_ranks, Path(d), timeout_s=400)[0]
    for mode in MODES:
        a, b = one[mode], tp[mode]
        print(f"\n{mode} (kernels one GPU {a['kernel']}, TP {b['kernel']}):")
        for rid in sorted(a["tokens"]):
            ta, tb = a["tokens"][rid], b["tokens"][rid]
            first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
            print(f"  {rid}: one {ta} TP {tb} first diff {first}")
        keys = sorted(set(a["sel"]) & set(b["sel"]))
        diff = [k for k in keys if a["sel"][k] != b["sel"][k]]
        print(f"  selections compared {len(keys)}, differing {len(diff)}")
        for k in diff[:12]:
            sa, sb = a["sel"][k], b["sel"][k]
            print(f"    layer {k[0]} row {k[1]} pos {k[2]}: |one - TP| {len(sa - sb)}, |TP - one| {len(sb - sa)}, "
                  f"size {len(sa)}")


if __name__ == "__main__":
    main()
