"""Batch-1 MoE layers of dsv32-bench-16l (15 MoE layers, graph replay): each gate/up and down choice forced for the
fused shared expert's E+1 keys, against the tables' choices and the unfused model.
(Reformatted for ruff after the run: the same statements.)
"""

import sys

import torch

sys.path.insert(0, "benchmarks")
from _timing import time_graph_us

from decode_server.model import build_random_model, load_config
from decode_server.model.moe import MoE, set_shared_experts_fusion
from kernels import fp8_gemm

cfg = load_config("dsv32-bench-16l")
dev = torch.device("cuda", 0)
results = {}


def moes_of(fused):
    set_shared_experts_fusion(fused)
    fp8_gemm.reset_tuner("table")
    model = build_random_model(cfg, dev, torch.bfloat16, seed=0, quantization="fp8")
    return model, [m for m in model.modules() if isinstance(m, MoE)]


def layers_us(moes, batch):
    xs = [torch.randn(batch, cfg.hidden_size, device=dev, dtype=torch.bfloat16) for _ in range(4)]

    def fn(i):
        for j, m in enumerate(moes):
            m(xs[(i + j) % 4])

    return time_graph_us(fn, 2, replays=7) / len(moes)


with torch.inference_mode():
    for batch in (1, 2):
        model, moes = moes_of(False)
        results[f"B{batch} unfused table"] = layers_us(moes, batch)
        del model, moes
        torch.cuda.empty_cache()
        model, moes = moes_of(True)
        print("fused:", sum(m.fuses_shared for m in moes), "of", len(moes))
        results[f"B{batch} fused table"] = layers_us(moes, batch)
        t = fp8_gemm.tuner()
        keys = [k for k in t._choices if k[0] == "grouped" and k[3] == 9]
        table = {k: t._choices[k] for k in keys}
        print({k[:5]: c.label() for k, c in table.items()})
        for key in keys:
            kind, n, k, e, bucket = key[:5]
            for cand in fp8_gemm.triton_candidates(kind, bucket, n, k, e, dev):
                t._choices[key] = cand
                try:
                    results[f"B{batch} {n}x{k} M<={bucket} {cand.label()}"] = layers_us(moes, batch)
                except Exception as exc:
                    print("fail", cand.label(), exc)
            t._choices[key] = table[key]
        del model, moes
        torch.cuda.empty_cache()
for k, v in results.items():
    print(f"{v:8.2f}  {k}")
