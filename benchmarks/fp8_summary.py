"""The short table at the end of benchmarks/fp8_gpu_suite.sh: what the FP8 GPU tests and benchmarks under an
output directory found (whatever finished: a stage cut short by its timeout shows as missing).

python benchmarks/fp8_summary.py OUT_DIR
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

TARGET_GEMM, TARGET_STEP, TARGET_HBM = 0.6, 0.7, 0.7


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def tests(out: Path) -> None:
    log = out / "fp8_tests.log"
    if not log.exists():
        print("tests: no log (stage not run)")
        return
    text = log.read_text(errors="replace")
    summary = [line for line in text.splitlines() if re.match(r"^=+ .*(passed|failed|error).* =+$", line)]
    print("tests: " + (summary[-1].strip("= ") if summary else "no pytest summary (cut short?)"))
    for line in text.splitlines():
        if line.startswith(("FAILED", "ERROR")):
            print("  " + line[:160])
    for line in text.splitlines():
        if "FP8-MODEL" in line:
            print("  " + line.strip())


def gemms(out: Path) -> None:
    data = _load(out / "bench_fp8_gemm.json")
    if not data:
        print("GEMM bench: no results")
        return
    meta = data["meta"]
    hbm = meta["hbm_copy_gbps"]
    print(f"GEMM bench ({meta['device']}, HBM copy {hbm:.0f} GB/s): µs per call, FP8 = autotuner's pick")
    print(f"  {'shape':<44}{'M':>4}{'bf16':>8}{'fp8':>8}{'ratio':>7}{'%HBM':>6}  pick")
    for r in data["rows"]:
        if r["m"] not in (1, 16, 64):
            continue
        if "error" in r:
            print(f"  {r['shape']:<44}{r['m']:>4}  error: {r['error'][:60]}")
            continue
        print(f"  {r['shape']:<44}{r['m']:>4}{r['bf16_us']:>8.1f}{r['auto_us']:>8.1f}{r['ratio_vs_bf16']:>7.2f}"
              f"{100 * r['fp8_gbps'] / hbm:>6.0f}  {r['auto_pick']}")
    for s in data.get("layer_summary", []):
        ok = "meets" if (s["m"] != 1 or s["ratio"] <= TARGET_GEMM) else "misses"
        name = s.get("form", s.get("routed_gate_up"))  # "routed_gate_up": results written before the engine form
        form = f" ({name})" if name else ""
        print(f"  one MoE layer's projections{form}, M={s['m']}: FP8/bf16 {s['ratio']:.2f}"
              + (f" ({ok} ≤ {TARGET_GEMM})" if s["m"] == 1 else "")
              + f", FP8 weights at {100 * s['layer_fp8_hbm_fraction']:.0f} % of HBM (target ≥ {100 * TARGET_HBM:.0f} %)")


def steps(out: Path) -> None:
    data = _load(out / "bench_fp8_step.json")
    if not data:
        print("step bench: no results")
        return
    meta = data["meta"]
    print(f"decode step ({meta['config']}, context {meta['context']}, graphs on): ms per step, FP8 vs bf16 weights")
    print(f"  {'batch':>5}{'fp8':>9}{'bf16':>9}{'ratio':>7}{'GEMM fp8':>10}{'GEMM bf16':>10}{'ratio':>7}"
          f"{'w/o lm_head':>12}")
    for r in data["rows"]:
        if "step_ratio" not in r:
            err = r.get("fp8_run", {}).get("error") or r.get("bf16_run", {}).get("error")
            print(f"  {r['batch']:>5}  error: {str(err)[:80]}")
            continue
        f8, b16 = r["fp8_run"], r["bf16_run"]
        print(f"  {r['batch']:>5}{f8['step_ms']:>9.3f}{b16['step_ms']:>9.3f}{r['step_ratio']:>7.2f}"
              f"{f8['gemm_ms']:>10.3f}{b16['gemm_ms']:>10.3f}{r['gemm_ratio']:>7.2f}"
              f"{r['gemm_ratio_without_lm_head']:>12.2f}")
    print(f"  targets at batch 1: GEMMs ≤ {TARGET_GEMM}×, step ≤ {TARGET_STEP}× bf16")


def main(argv: list[str]) -> int:
    out = Path(argv[1] if len(argv) > 1 else "gpu-out")
    print(f"=== FP8 weights (issue 21): summary of {out} ===")
    tests(out)
    gemms(out)
    steps(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
