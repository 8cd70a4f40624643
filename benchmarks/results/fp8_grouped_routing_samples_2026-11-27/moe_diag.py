"""Why the tuner's isolated timing of the E+1 bucket-4 keys differs from the step: per-candidate isolated times
with the tuner's own sample (4 rows, random experts), 3 rows on 3 distinct experts (batch 1's), 4 rows distinct;
plus kernel times inside the 15-layer MoE graph for the table's and the best in-context choices.
(Reformatted for ruff after the run: the same statements.)"""

import functools
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "benchmarks")
from decode_server.model import build_random_model, load_config
from decode_server.model.moe import MoE, set_shared_experts_fusion
from kernels import fp8_gemm
from kernels.fp8_gemm import _random_weights, _run_grouped, _time_us, triton_candidates

dev = torch.device("cuda", 0)
block = (128, 128)
for n, k in ((4096, 7168), (7168, 2048)):
    E, bucket = 9, 4
    gen = torch.Generator(device=dev).manual_seed(n * 131 + k)
    pool = [_random_weights((E, n, k), block, dev, gen) for _ in range(6)]
    x4 = torch.randn(bucket, k, device=dev, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    ids = torch.randint(0, E, (bucket,), device=dev, generator=gen).sort().values

    def offs(ids, E=E):
        return torch.searchsorted(ids, torch.arange(E, device=dev), right=True).to(torch.int32)

    samples = {
        "tuner 4 random " + str(ids.tolist()): (x4, offs(ids)),
        "3 distinct [2,5,8]": (x4[:3].contiguous(), offs(torch.tensor([2, 5, 8], device=dev))),
        "4 distinct [1,3,5,8]": (x4, offs(torch.tensor([1, 3, 5, 8], device=dev))),
    }
    cands = triton_candidates("grouped", bucket, n, k, E, dev)
    print(f"== {n}x{k} E={E} M<={bucket}")
    res = {}
    for name, (x, o) in samples.items():
        fns = [
            functools.partial(
                lambda c, i, x=x, o=o, pool=pool: _run_grouped(
                    c, x, *pool[i % len(pool)], o, block, torch.bfloat16
                ),
                c,
            )
            for c in cands
        ]
        res[name] = _time_us(fns, 60)
    print(f"{'candidate':40s}" + "".join(f"{nm[:22]:>24s}" for nm in samples))
    for i, c in enumerate(cands):
        print(f"{c.label():40s}" + "".join(f"{res[nm][i]:24.2f}" for nm in samples))

# kernel times in context
cfg = load_config("dsv32-bench-16l")
set_shared_experts_fusion(True)
fp8_gemm.reset_tuner("table")
with torch.inference_mode():
    model = build_random_model(cfg, dev, torch.bfloat16, seed=0, quantization="fp8")
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    x = torch.randn(1, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    for m in moes:
        m(x)
    t = fp8_gemm.tuner()
    key_gu = next(kk for kk in t._choices if kk[:5] == ("grouped", 4096, 7168, 9, 4))
    key_dn = next(kk for kk in t._choices if kk[:5] == ("grouped", 7168, 2048, 9, 4))
    table = (t._choices[key_gu], t._choices[key_dn])
    best = (
        [
            c
            for c in triton_candidates("grouped", 4, 4096, 7168, 9, dev)
            if c.label() == "triton gemv bn8 g4 w4 ls3 rp"
        ][0],
        [
            c
            for c in triton_candidates("grouped", 4, 7168, 2048, 9, dev)
            if c.label() == "triton gemv bn16 g4 w4 ls3 rp"
        ][0],
    )
    for label, (gu, dn) in (("table", table), ("in-context best", best)):
        t._choices[key_gu], t._choices[key_dn] = gu, dn
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for m in moes:
                m(x)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            for m in moes:
                m(x)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                g.replay()
            torch.cuda.synchronize()
        st = torch.cuda.Event(enable_timing=True)
        en = torch.cuda.Event(enable_timing=True)
        st.record()
        for _ in range(20):
            g.replay()
        en.record()
        torch.cuda.synchronize()
        print(
            f"== {label}: {gu.label()} / {dn.label()}: {st.elapsed_time(en) * 1000 / 20 / len(moes):.2f} us per layer"
        )
        agg = {}
        for e in prof.events():
            if e.device_type.name == "CUDA":
                a = agg.setdefault(e.name[:70], [0.0, 0])
                a[0] += e.device_time
                a[1] += 1
        for nm, (tt, c) in sorted(agg.items(), key=lambda kv: -kv[1][0]):
            print(f"  {tt / 10 / len(moes):8.2f} us/layer  {c / 10 / len(moes):5.2f}/layer  {nm}")
