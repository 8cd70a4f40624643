"""The short table of benchmarks/rank_gpu_suite.sh (issue 22): every bench_decode JSON under a directory, one line
a run, with HiSparse's tokens/s over dense's at the same context and budget.

    python benchmarks/rank_summary.py gpu-out
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(directory: Path) -> list[str]:
    out = [f"{'file':<22}{'run':<20}{'ctx':>7}{'KV GiB':>8}{'batch':>6}{'tok/s':>10}{'xdense':>8}{'step ms':>9}"
           f"{'floor ms':>9}{'step/fl':>8}{'hit':>6}"]
    for path in sorted(directory.glob("rank_*.json")):
        data = json.loads(path.read_text())
        results = data.get("results", [])
        dense = {(r["context"], r.get("sweep_kv_gib_per_layer")): r["tokens_per_s"] for r in results
                 if r.get("mode") == "dense" and not r.get("fixed_batch") and "error" not in r}
        for r in results:
            run = r["mode"] + (f"@B{r['fixed_batch']}" if r.get("fixed_batch") else "") + (
                f"@{r['sweep_kv_gib_per_layer']:g}G/L" if r.get("sweep_kv_gib_per_layer") is not None else "")
            if "error" in r:
                out.append(f"{path.stem:<22}{run:<20}{r['context']:>7}  error: {r['error'][:70]}")
                continue
            base = dense.get((r["context"], r.get("sweep_kv_gib_per_layer")))
            ratio = f"{r['tokens_per_s'] / base:.2f}" if base and not r.get("fixed_batch") else "-"
            hit = f"{r['hit_rate']:.2f}" if r.get("hit_rate") is not None else "-"
            out.append(f"{path.stem:<22}{run:<20}{r['context']:>7}{r['kv_budget_gib']:>8.2f}{r['batch']:>6}"
                       f"{r['tokens_per_s']:>10.1f}{ratio:>8}{r['step_ms']:>9.2f}{r['floor_ms']:>9.2f}"
                       f"{r['step_over_floor']:>8.2f}{hit:>6}")
    return out


if __name__ == "__main__":
    print("\n".join(rows(Path(sys.argv[1] if len(sys.argv) > 1 else "gpu-out"))))
