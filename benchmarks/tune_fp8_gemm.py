"""Measure the FP8 GEMM choices of real models on this GPU and write its table (kernels/fp8_gemm_tables/).

The engine reads the table at warm-up ("table" mode, kernels/fp8_gemm_table.py): each (shape, M bucket) then runs
the kernel measured fastest here, and every process on this GPU model decides the same. This script runs the
engine's own warm-up (decode_server/model/fp8_warmup.py) in "measure" mode on a short model of each requested
configuration — the first dense layer and one MoE layer, which hold every FP8 shape of the model — with random FP8
weights drawn on the GPU, for each parallel layout (TP×EP: one rank's shard), and merges the decisions into the
table of this GPU model.

GPU:  python benchmarks/tune_fp8_gemm.py --configs deepseek-v3.2 glm-5 --parallel 1x1 8x8 8x1 [--max-tokens 512]
      python benchmarks/tune_fp8_gemm.py --configs dsv32-rank-ep8 --min-tokens 512 --max-tokens 2048
          (prefill chunks' buckets only; the decode sizes' entries are kept as measured)
      python benchmarks/tune_fp8_gemm.py --shapes 2240:7168 --out kernels/fp8_gemm_tables/<gpu>.json
          (only the weights of these N:K, merged into the table: its other entries are kept as measured)
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from decode_server.model import load_config  # noqa: E402
from decode_server.model.construct import build_random_model  # noqa: E402
from decode_server.model.fp8_warmup import tuning_config, warm_up  # noqa: E402
from decode_server.parallel.state import ParallelState  # noqa: E402
from kernels import fp8_gemm  # noqa: E402
from kernels.fp8_gemm_table import config_fields, dtype_name, table_path, write_table  # noqa: E402

logger = logging.getLogger("tune_fp8_gemm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["deepseek-v3.2"])
    parser.add_argument("--parallel", nargs="+", default=["1x1"], help="TPxEP layouts, e.g. 1x1 8x8 8x1")
    parser.add_argument("--max-tokens", type=int, default=512, help="largest token count (M) to tune, a power of two")
    parser.add_argument("--min-tokens", type=int, default=1,
                        help="smallest token count (M) to tune, a power of two: 512 with --max-tokens 2048 adds "
                             "prefill chunks' buckets without measuring the decode sizes again")
    parser.add_argument("--out", type=Path, default=None, help="table file (default: this GPU model's)")
    parser.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="N:K",
                        help="tune only the weights of these shapes (N out, K in features); the table's other "
                             "entries are kept")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    counts = [1 << i for i in range(args.max_tokens.bit_length()) if args.min_tokens <= 1 << i <= args.max_tokens]
    if not counts:
        parser.error(f"no power of two between --min-tokens {args.min_tokens} and --max-tokens {args.max_tokens}")
    entries: dict[tuple, dict] = {}
    started = time.perf_counter()
    for config_name in args.configs:
        cfg = tuning_config(load_config(config_name))
        for layout in args.parallel:
            tp, ep = (int(v) for v in layout.lower().split("x"))
            parallel = ParallelState(tp_rank=0, tp_size=tp, ep_size=ep)
            fp8_gemm.reset_tuner("measure")
            model = build_random_model(cfg, device, torch.bfloat16, parallel=parallel, quantization="fp8")
            t0 = time.perf_counter()
            shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes] if args.shapes else None
            records = warm_up(model, counts, int(cfg.num_experts_per_tok), shapes=shapes)
            logger.info("%s TP%d EP%d: %d decisions in %.1f s", config_name, tp, ep, len(records),
                        time.perf_counter() - t0)
            for r in records:
                key = (r.kind, r.n, r.k, r.experts, r.bucket)
                entries[key] = {"kind": r.kind, "n": r.n, "k": r.k, "experts": r.experts, "bucket": r.bucket,
                                "dtype": dtype_name(torch.bfloat16), "backend": r.choice.backend,
                                "config": config_fields(r.choice.config),
                                "us": {label: round(us, 2) for label, us in r.timings_us.items()},
                                "source": f"{config_name} TP{tp} EP{ep}"}
            del model
            torch.cuda.empty_cache()
    rows = sorted(entries.values(), key=lambda e: (e["kind"], e["n"], e["k"], e["experts"], e["bucket"]))
    for e in rows:
        best = min(e["us"].values()) if e["us"] else float("nan")
        default = next((us for label, us in e["us"].items() if label.startswith("triton")), float("nan"))
        print(f"{e['kind']:7s} N={e['n']:6d} K={e['k']:6d} E={e['experts']:3d} M≤{e['bucket']:5d}: "
              f"{e['backend']:9s} {best:8.1f} µs (fastest triton {min((us for lb, us in e['us'].items() if lb.startswith('triton')), default=default):.1f})")
    path = args.out or table_path(name)
    if not args.dry_run:
        meta = {"torch": torch.__version__, "triton": __import__("triton").__version__,
                "measured": datetime.now(UTC).strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
        total = write_table(path, name, rows, meta)
        print(f"wrote {len(rows)} entries ({total} in all) to {path} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
