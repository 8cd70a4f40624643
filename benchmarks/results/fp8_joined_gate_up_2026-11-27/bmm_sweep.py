"""Sweep the batched FP8 kernel's launch configurations at MLA's absorbed shapes (128 heads, one row each: W_UK
N 512 K 128, W_UV N 128 K 512), graph-replay timed over 24 weight copies (no L2 reuse), against a plain copy_ of
the same bytes. Run from the repo root on a GPU (session 16, 2026-11-27; this is the script as run, reformatted
for ruff): python benchmarks/results/fp8_joined_gate_up_2026-11-27/bmm_sweep.py"""

import itertools
import sys

import torch

sys.path.insert(0, ".")
from kernels import fp8_gemm  # noqa: E402
from kernels.fp8_bmm_triton import fp8_bmm  # noqa: E402
from kernels.fp8_gemm_ref import fp8_bmm_ref  # noqa: E402
from kernels.fp8_gemm_triton import TritonGemmConfig  # noqa: E402

COPIES = 24
SHAPES = [("W_UK", 128, 512, 128, 1), ("W_UV", 128, 128, 512, 1), ("W_UK", 128, 512, 128, 2),
          ("W_UV", 128, 128, 512, 2), ("W_UK tp8", 16, 512, 128, 1)]


def configs(k: int) -> list[TritonGemmConfig]:
    out = []
    for bn, groups, warps, stages in itertools.product((16, 32, 64, 128), (1, 4), (1, 2, 4, 8), (1, 2)):
        if (groups > 1 and k <= 128) or (stages > 1 and k // (groups * 128) < 2):
            continue
        out.append(TritonGemmConfig(block_n=bn, num_warps=warps, gemv_groups=groups, gemv_stages=stages,
                                    fuse_quant=True))
    for bn, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4)):
        out.append(TritonGemmConfig(block_m=16, block_n=bn, num_warps=warps, num_stages=stages, fuse_quant=True))
    return out


def sweep(name: str, g: int, n: int, k: int, m: int, dev: torch.device) -> None:
    ws = [(torch.randn(g, n, k, device=dev).mul(64).clamp(-448, 448).to(torch.float8_e4m3fn),
           torch.rand(g, max(1, n // 128), k // 128, device=dev).add(0.5).mul(2**-10)) for _ in range(COPIES)]
    a = torch.randn(g, m, k, device=dev, dtype=torch.bfloat16)
    out = torch.empty(g, m, n, device=dev, dtype=torch.bfloat16)
    ref = fp8_bmm_ref(a.float(), ws[0][0], ws[0][1]).to(torch.bfloat16)
    ok = []
    for c in configs(k):
        try:
            fp8_bmm(a, ws[0][0], ws[0][1], out, c)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 — a configuration that does not build is left out
            print("fail", c.label(), type(e).__name__, str(e)[:100])
            continue
        err = (out.float() - ref.float()).abs().max().item()
        if err > 1e-2 * ref.float().abs().max().item():
            print("mismatch", c.label(), err)
            continue
        ok.append(c)

    def run(c: TritonGemmConfig):
        return lambda i: fp8_bmm(a, ws[i % COPIES][0], ws[i % COPIES][1], out, c)

    src = [torch.empty(g * n * k, dtype=torch.uint8, device=dev) for _ in range(COPIES)]
    dst = torch.empty_like(src[0])
    times = fp8_gemm._time_us([run(c) for c in ok] + [lambda i: dst.copy_(src[i % COPIES])], 48)
    weight_bytes = g * n * k
    ranked = sorted(zip([c.label() for c in ok] + ["copy (read+write)"], times, strict=True), key=lambda x: x[1])
    print(f"\n{name} G{g} N{n} K{k} M{m}: {weight_bytes / 1e6:.1f} MB; copy {times[-1]:.2f} us")
    for label, us in ranked[:12]:
        print(f"  {label:34s} {us:6.2f} us  {weight_bytes / us / 1e3:6.0f} GB/s")


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    for shape in SHAPES:
        sweep(*shape, dev)


if __name__ == "__main__":
    main()
