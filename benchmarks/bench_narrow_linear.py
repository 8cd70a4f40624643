"""The narrow float32 projections of a decode step (MoE router, indexer head weights): F.linear against
`decode_server.model.layers.narrow_linear` (split-K batched GEMM + ordered sum).

Times are µs per call in a replayed CUDA graph of many calls (the decode step's setting), each call on another
copy of the weight (L2 does not hold them). Also prints the largest difference to a float64 product relative to
the output's range, for both.

GPU:  python benchmarks/bench_narrow_linear.py [--rows 1 4 16 64 256] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _timing import device_name, time_graph_us  # noqa: E402

from decode_server.model.layers import narrow_linear  # noqa: E402

SHAPES = [("router 256 experts", 256, 7168), ("router 32 (EP8 rank's config)", 32, 7168),
          ("router 8 (bench)", 8, 7168), ("indexer head weights", 64, 7168), ("GLM-5 indexer", 32, 6144)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--copies", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    print(f"{device_name()}: µs per call (graph replay), max |error| / max |y| against float64")
    print(f"  {'shape':30s} {'T':>4s} {'F.linear':>9s} {'narrow':>8s} {'speed-up':>8s} {'err F':>9s} {'err narrow':>10s}")
    for name, n, k in SHAPES:
        weights = [torch.randn(n, k, device="cuda", generator=gen) * k**-0.5 for _ in range(args.copies)]
        for t in args.rows:
            x = torch.randn(t, k, device="cuda", generator=gen)
            base = time_graph_us(lambda i, x=x, ws=weights: F.linear(x, ws[i % len(ws)]), 4 * len(weights))
            fast = time_graph_us(lambda i, x=x, ws=weights: narrow_linear(x, ws[i % len(ws)]), 4 * len(weights))
            exact = (x.double() @ weights[0].double().t())
            scale = float(exact.abs().max())
            err_base = float((F.linear(x, weights[0]).double() - exact).abs().max()) / scale
            err_fast = float((narrow_linear(x, weights[0]).double() - exact).abs().max()) / scale
            rows_out.append({"shape": name, "n": n, "k": k, "rows": t, "f_linear_us": base, "narrow_us": fast,
                             "rel_err_f_linear": err_base, "rel_err_narrow": err_fast})
            print(f"  {name:30s} {t:4d} {base:9.1f} {fast:8.1f} {base / fast:7.2f}x {err_base:9.2e} {err_fast:10.2e}")
    if args.out:
        args.out.write_text(json.dumps({"device": device_name(), "date": datetime.now(UTC).isoformat(),
                                        "command": " ".join(sys.argv), "rows": rows_out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
