"""Fit of the Gluon kernel's tile costs in kernels/sparse_mla_plan.py to its measured split sweeps (every split
count timed at every batch, so each choice's time is a measured number): prints the worst and mean chosen / best
for a grid of (bf16, FP8) tile costs at the shared per-program cost, best first.

    PYTHONPATH=$PWD python3 benchmarks/results/sparse_mla_gluon_engine_2026-11-28/fit_splits.py \\
        benchmarks/results/sparse_mla_gluon_engine_2026-11-28/h1*_splits_gluon.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import kernels.sparse_mla_plan as plan


def score(rows: list[dict], bf16_us: float, fp8_us: float) -> tuple[float, float]:
    plan._GLUON_TILE_US = {False: bf16_us, True: fp8_us}
    ratios = []
    for r in rows:
        times = {int(k): v for k, v in r["times_us"].items()}
        chosen = plan.choose_splits(r["batch"], r["heads"], 2048, 64, 64, 132, r["fmt"] == "fp8", "gluon")
        ratios.append(times[chosen] / min(times.values()))
    return max(ratios), sum(ratios) / len(ratios)


def main() -> None:
    rows = [r for path in sys.argv[1:] for r in json.loads(Path(path).read_text())["split_sweep"] if r.get("kernel") == "gluon"]
    grid = [(score(rows, b, f), b, f) for b in (2.0, 2.2, 2.5, 2.8, 3.0, 3.2, 3.5, 3.7)
            for f in (3.0, 3.2, 3.5, 3.8, 4.0, 4.2, 4.5, 5.0)]
    for (worst, mean), b, f in sorted(grid)[:8]:
        print(f"bf16 {b} µs, FP8 {f} µs: worst {worst:.3f}, mean {mean:.4f}")


if __name__ == "__main__":
    main()
