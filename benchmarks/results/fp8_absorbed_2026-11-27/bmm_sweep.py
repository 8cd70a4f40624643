# ruff: noqa
"""Absorbed MLA products per layer: FP8 batched kernel (tuned table) vs the bf16 batched matmuls the model ran
before, DeepSeek-V3.2 at TP1 (128 heads), 16 layers rotated (537 MB of bf16 weights: no L2 reuse), CUDA graphs."""
import json, sys
import torch
from decode_server.model.fp8 import quantize_block_fp8, dequantize_block_fp8
from kernels import fp8_gemm

H, NOPE, ROPE, LORA, V, LAYERS = 128, 128, 64, 512, 128, 16
torch.manual_seed(0)
fp8_gemm.reset_tuner("table")
layers = []
for _ in range(LAYERS):
    w, s = quantize_block_fp8(torch.randn(H * (NOPE + V), LORA, device="cuda") * 0.02)
    heads, blocks = w.view(H, NOPE + V, LORA), s.view(H, 2, LORA // 128)
    deq = dequantize_block_fp8(w, s).to(torch.bfloat16).view(H, NOPE + V, LORA)
    layers.append(dict(uk=heads[:, :NOPE].transpose(1, 2).contiguous(), uk_s=blocks[:, :1].transpose(1, 2).contiguous(),
                       uv=heads[:, NOPE:], uv_s=blocks[:, 1:], uk16=deq[:, :NOPE].contiguous(), uv16=deq[:, NOPE:].contiguous()))


def timed(fn, reps=20):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(g, stream=s):
        fn()
    g.replay(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        a.record()
        for _ in range(reps):
            g.replay()
        b.record(); b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps / LAYERS)
    return sorted(times)[1]


rows = []
for T in (1, 2, 4, 8, 16, 32, 64, 128, 256):
    q = torch.randn(T, H, NOPE + ROPE, device="cuda").to(torch.bfloat16)
    lat = torch.randn(T, H, LORA, device="cuda").to(torch.bfloat16)
    query = torch.empty(T, H, LORA + ROPE, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(T, H, V, device="cuda", dtype=torch.bfloat16)
    for L in layers[:1]:  # decide (table) before capture
        fp8_gemm.fp8_batched_linear(q[..., :NOPE].transpose(0, 1), L["uk"], L["uk_s"], query[..., :LORA].transpose(0, 1))
        fp8_gemm.fp8_batched_linear(lat.transpose(0, 1), L["uv"], L["uv_s"], out.transpose(0, 1))

    def fp8_uk():
        for L in layers:
            fp8_gemm.fp8_batched_linear(q[..., :NOPE].transpose(0, 1), L["uk"], L["uk_s"], query[..., :LORA].transpose(0, 1))

    def fp8_uv():
        for L in layers:
            fp8_gemm.fp8_batched_linear(lat.transpose(0, 1), L["uv"], L["uv_s"], out.transpose(0, 1))

    def bf16_uk():
        for L in layers:
            query[..., :LORA] = torch.matmul(q[..., :NOPE].transpose(0, 1), L["uk16"]).transpose(0, 1)

    def bf16_uv():
        for L in layers:
            o = torch.matmul(lat.transpose(0, 1), L["uv16"].transpose(1, 2))
            o.transpose(0, 1).reshape(T, H * V)

    r = dict(T=T, fp8_uk=timed(fp8_uk), fp8_uv=timed(fp8_uv), bf16_uk=timed(bf16_uk), bf16_uv=timed(bf16_uv))
    r["fp8"] = r["fp8_uk"] + r["fp8_uv"]; r["bf16"] = r["bf16_uk"] + r["bf16_uv"]
    r["fp8_TBps"] = 2 * H * NOPE * LORA / (r["fp8"] * 1e-6) / 1e12
    r["bf16_TBps"] = 4 * H * NOPE * LORA / (r["bf16"] * 1e-6) / 1e12
    rows.append(r)
recs = [rec for rec in fp8_gemm.tuner().records if rec.kind == "batched"]
print("chosen:", sorted({(rec.n, rec.k, rec.bucket, rec.choice.label(), rec.source) for rec in recs})[:40])
print(f"{'T':>4} {'fp8 uk':>7} {'fp8 uv':>7} {'bf16 uk':>7} {'bf16 uv':>7} {'fp8':>7} {'bf16':>7} ratio  TB/s fp8 bf16 (µs per layer)")
for r in rows:
    print(f"{r['T']:4d} {r['fp8_uk']:7.2f} {r['fp8_uv']:7.2f} {r['bf16_uk']:7.2f} {r['bf16_uv']:7.2f} {r['fp8']:7.2f} "
          f"{r['bf16']:7.2f} {r['fp8'] / r['bf16']:5.2f} {r['fp8_TBps']:5.2f} {r['bf16_TBps']:5.2f}")
json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), open(sys.argv[1], "w"), indent=1)
