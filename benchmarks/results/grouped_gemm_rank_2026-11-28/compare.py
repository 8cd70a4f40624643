# ruff: noqa  -- kept as it ran
"""The grouped FP8 GEMM at the rank shapes, timed in CUDA graphs: HEAD's kernel (bench_tmp/old_fp8_gemm_triton.py)
against this tree's with the same launch (the table's choice), then this tree's new candidates; a read of the
weight bytes as the floor. Outputs compared bit for bit."""
import importlib.util, json, os, statistics, sys
import torch, triton, triton.language as tl
from kernels import fp8_gemm_triton as T
from kernels.fp8_gemm import triton_candidates
from kernels.fp8_gemm_table import device_table

spec = importlib.util.spec_from_file_location("old_fp8", "bench_tmp/old_fp8_gemm_triton.py")
OLD = importlib.util.module_from_spec(spec); sys.modules["old_fp8"] = OLD; spec.loader.exec_module(OLD)
dev = torch.device("cuda")
SMS = torch.cuda.get_device_properties(0).multi_processor_count
table = device_table(torch.cuda.get_device_name(0))


@triton.jit
def _read(p, out, nbytes, CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros((CHUNK,), dtype=tl.int32)
    offs = tl.arange(0, CHUNK)
    for c in range(pid, nbytes // (CHUNK * 4), tl.num_programs(0)):
        acc ^= tl.load(p + c.to(tl.int64) * CHUNK + offs, cache_modifier=".cg")
    tl.store(out + pid * CHUNK + offs, acc)


def graph_us(fn, calls=10, rounds=5):
    fn(); torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / calls)
    return statistics.median(ts)


def routing(batch, routed=32, per_token=8):
    g = torch.Generator().manual_seed(1000 + batch)
    ids = []
    for _ in range(batch):
        ids += torch.randperm(routed, generator=g)[:per_token].tolist() + [routed]
    counts = torch.bincount(torch.tensor(ids), minlength=routed + 1)
    return len(ids), torch.cumsum(counts, 0).to(torch.int32).to(dev)


E = 33
rows = []
for name, n, k in [("glm5 gate_up", 4096, 6144), ("glm5 down", 6144, 2048), ("dsv32 gate_up", 4096, 7168),
                   ("dsv32 down", 7168, 2048)]:
    torch.manual_seed(0)
    w = (torch.randn(E, n, k, device=dev) * 0.5).to(torch.float8_e4m3fn)
    ws = torch.rand(E, n // 128, k // 128, device=dev) * 1e-2 + 1e-3
    wbytes = w.numel() + ws.numel() * 4
    out = torch.empty(SMS * 8 * 1024, dtype=torch.int32, device=dev)
    read_us = graph_us(lambda: _read[(SMS * 8,)](w.view(torch.int32), out, w.numel(), CHUNK=1024))
    print(f"## {name} N {n} K {k} E {E}: {wbytes/1e6:.1f} MB, read {read_us:.1f} us ({wbytes/read_us/1e3:.0f} GB/s)")
    for batch in (16, 42, 57, 64):
        m, ends = routing(batch)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        q, s = T.quantize_activations(x)
        bucket = 1 << (m - 1).bit_length()
        backend, fields = table[("grouped", n, k, E, bucket, "bfloat16")]
        tuned = T.TritonGemmConfig(**fields)
        old_cfg = OLD.TritonGemmConfig(**{f: v for f, v in fields.items() if f in OLD.TritonGemmConfig.__dataclass_fields__})
        ref = OLD.fp8_grouped_gemm(q, s, w, ws, ends, torch.bfloat16, old_cfg)
        res = [("HEAD kernel, table " + tuned.label(), graph_us(lambda: OLD.fp8_grouped_gemm(q, s, w, ws, ends, torch.bfloat16, old_cfg)), True)]
        y = T.fp8_grouped_gemm(q, s, w, ws, ends, torch.bfloat16, tuned)
        res.append(("new kernel, table " + tuned.label(), graph_us(lambda: T.fp8_grouped_gemm(q, s, w, ws, ends, torch.bfloat16, tuned)), torch.equal(y, ref)))
        for c in triton_candidates("grouped", bucket, n, k, E, dev):
            if c.config.gemv_groups or c.config == tuned:
                continue
            y = T.fp8_grouped_gemm(q, s, w, ws, ends, torch.bfloat16, c.config)
            res.append((c.label(), graph_us(lambda: T.fp8_grouped_gemm(q, s, w, ws, ends, torch.bfloat16, c.config)), torch.equal(y, ref)))
        print(f"B {batch} ({m} rows, bucket {bucket}):")
        for label, us, same in sorted(res, key=lambda r: r[1]):
            print(f"   {label:44s} {us:7.1f} us {wbytes/us/1e3:5.0f} GB/s {100*read_us/us:5.1f}% of read  same-bits={same}")
        rows.append({"shape": name, "n": n, "k": k, "batch": batch, "rows": m, "read_us": read_us, "results": res})
    del w, ws
    torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "compare.json"), "w"), indent=1)
