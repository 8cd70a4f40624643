"""The scores kernel before (d9f6d77) and after the 2026-11-26 change, each L2 flush method, same run, same inputs;
asserts that the two give the same bits. Run from the repository root after
`mkdir -p bench_tmp && git show d9f6d77:kernels/indexer_fast.py > bench_tmp/indexer_fast_old.py`:
    PYTHONPATH=$PWD python3 benchmarks/results/indexer_scores_2026-11-26/sweep_old_vs_new.py
"""

import sys

sys.path[:0] = ["benchmarks", ".", "bench_tmp"]

import bench_indexer as bi  # noqa: E402
import indexer_fast_old as old  # noqa: E402
import torch  # noqa: E402

import kernels.indexer_fast as kf  # noqa: E402

SHAPES = [(b, n) for b in (1, 16, 64) for n in (8192, 32768, 65536, 131072)]
VARIANTS = [
    ("old fp16", lambda a: old.indexer_scores_fast(*a, old.FastScoresConfig(precision="fp16"))),
    ("old fp8", lambda a: old.indexer_scores_fast(*a, old.FastScoresConfig(precision="fp8"))),
    ("new fp16", lambda a: kf.indexer_scores_fast(*a, kf.FastScoresConfig(precision="fp16"))),
    ("new fp8", lambda a: kf.indexer_scores_fast(*a, kf.FastScoresConfig(precision="fp8"))),
]


def main() -> None:
    res = {}
    hbm = bi.hbm_copy_gbps()
    print(f"HBM copy {hbm:.0f} GB/s", flush=True)
    for flush in ("write", "read"):
        args = type("Args", (), {"flush": flush, "layout": "paged", "json": None, "configs": False, "no_main": True})
        bench = bi.Bench(args)
        for batch, length in SHAPES:
            inp = bench.inputs(batch, length, batch * 7 + length)
            outs = {}
            for name, fn in VARIANTS:
                outs[name] = fn(inp)
                us = bench.time(lambda fn=fn, inp=inp: fn(inp))
                res[(flush, batch, length, name)] = (us, batch * length * bi.BYTES_PER_POSITION / (us * 1e-6) / 1e9 / hbm)
            assert torch.equal(outs["old fp8"], outs["new fp8"]), (batch, length, "fp8 differs")
            assert torch.equal(outs["old fp16"], outs["new fp16"]), (batch, length, "fp16 differs")
        del bench
        torch.cuda.empty_cache()
    print("old == new bit for bit at every shape (fp16, fp8)")
    print(f"\nscores kernel: fraction of the HBM copy ({hbm:.0f} GB/s), us; flush write | read")
    names = [n for n, _ in VARIANTS]
    print(f"{'B':>3} {'L':>6} | " + " ".join(f"{n:>15}" for n in names) + " | " + " ".join(f"{n:>15}" for n in names))
    for batch, length in SHAPES:
        cells = [f"{res[(f, batch, length, n)][1]:6.1%} {res[(f, batch, length, n)][0]:7.1f}"
                 for f in ("write", "read") for n in names]
        print(f"{batch:3d} {length:6d} | " + " ".join(f"{c:>15}" for c in cells[:4]) + " | "
              + " ".join(f"{c:>15}" for c in cells[4:]))


if __name__ == "__main__":
    main()
