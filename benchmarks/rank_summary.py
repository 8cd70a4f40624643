"""The short table of benchmarks/rank_gpu_suite.sh (issue 22): every bench_decode JSON under a directory, one line
a run, with HiSparse's tokens/s over dense's at the same context and budget. With --plot, the runs of all stages
in one figure: tok/s against context for each mode (batch-1 runs left out), and HiSparse / dense against the KV
budget per layer when a sweep is there (<plot stem>_sweep.png).

    python benchmarks/rank_summary.py gpu-out [--plot gpu-out/rank_context.png]
"""

from __future__ import annotations

import argparse
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


def merged_results(directory: Path) -> list[dict]:
    """Every run of every rank_*.json (errors and fixed-batch runs left out): one list for bench_decode's plots."""
    out = []
    for path in sorted(directory.glob("rank_*.json")):
        out += [r for r in json.loads(path.read_text()).get("results", [])
                if "error" not in r and not r.get("fixed_batch")]
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", nargs="?", default="gpu-out", type=Path)
    parser.add_argument("--plot", type=Path, default=None, help="write the merged plots here (needs matplotlib)")
    args = parser.parse_args(argv)
    print("\n".join(rows(args.directory)))
    if args.plot is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_decode import write_plots  # torch and the engine: only when plotting

        for written in write_plots(merged_results(args.directory), args.plot):
            print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
