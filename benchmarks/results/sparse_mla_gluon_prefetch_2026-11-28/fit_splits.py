"""Fit of the Gluon kernel's split-model constants in kernels/sparse_mla_plan.py (tile costs for bf16 and FP8 rows,
per-program cost) to its measured split sweeps (every split count timed at every batch, so each choice's time is a
measured number): prints the worst and mean chosen / best for the best grid points, then the misses > 3 % of the
chosen point.

    PYTHONPATH=$PWD python3 benchmarks/results/sparse_mla_gluon_prefetch_2026-11-28/fit_splits.py \\
        benchmarks/results/sparse_mla_gluon_prefetch_2026-11-28/h*_splits_gluon.json
"""
from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import kernels.sparse_mla_plan as plan


def evaluate(rows: list[dict], bf16_us: float, fp8_us: float, program_us: float, show: bool = False
             ) -> tuple[float, float]:
    plan._GLUON_TILE_US = {False: bf16_us, True: fp8_us}
    plan._GLUON_PROGRAM_US = program_us
    ratios = []
    for r in rows:
        times = {int(k): v for k, v in r["times_us"].items()}
        chosen = plan.choose_splits(r["batch"], r["heads"], 2048, 64, 64, 132, r["fmt"] == "fp8", "gluon")
        ratio = times[chosen] / min(times.values())
        if show and ratio > 1.03:
            print(f"  {r['file']} {r['fmt']} H {r['heads']} B {r['batch']}: chosen {chosen}, best "
                  f"{min(times, key=times.get)}, {ratio:.3f}")
        ratios.append(ratio)
    return max(ratios), sum(ratios) / len(ratios)


def main() -> None:
    rows = [dict(r, file=Path(path).name) for path in sys.argv[1:]
            for r in json.loads(Path(path).read_text())["split_sweep"] if r.get("kernel") == "gluon"]
    grid = sorted((evaluate(rows, b, f, p), b, f, p) for b, f, p in itertools.product(
        (1.4, 1.6, 1.8, 2.0, 2.2, 2.5, 2.8), (2.6, 2.8, 3.0, 3.2, 3.5, 3.8, 4.0), (2.0, 3.0, 4.0, 5.0, 6.0)))
    for (worst, mean), b, f, p in grid[:6]:
        print(f"bf16 {b} µs, FP8 {f} µs, program {p} µs: worst {worst:.3f}, mean {mean:.4f}")
    evaluate(rows, *grid[0][1:], show=True)


if __name__ == "__main__":
    main()
