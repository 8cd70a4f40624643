"""The split choice of kernels/sparse_mla_plan.py replayed on the measured split sweeps of 2026-11-28 (every split
count was timed at every point, so the chosen split's time is a measured number): worst and over-3 % points per
sweep. No GPU needed.

    PYTHONPATH=$PWD python3 benchmarks/results/sparse_mla_fp8_prescaled_2026-11-28/replay_splits.py
"""
from __future__ import annotations

import json
from pathlib import Path

from kernels.sparse_mla_plan import choose_splits

HERE = Path(__file__).resolve().parent


def main() -> None:
    for name in ("h200_sweep.json", "h100_sweep.json", "h200_sweep_masked_idx.json"):
        worst, off = 1.0, []
        for row in json.loads((HERE / name).read_text())["split_sweep"]:
            times = {int(s): us for s, us in row["times_us"].items()}
            chosen = choose_splits(row["batch"], row["heads"], 2048, 64, 64, 132, row["fmt"] == "fp8")
            ratio = times[chosen] / min(times.values())
            worst = max(worst, ratio)
            if ratio > 1.03:
                off.append(f"{row['fmt']} H {row['heads']} B {row['batch']}: {chosen} splits {ratio:.3f}")
        print(f"{name}: worst chosen / best {worst:.3f}; over 3 %: {'; '.join(off) or 'none'}")


if __name__ == "__main__":
    main()
