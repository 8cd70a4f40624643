"""Old against new plan kernel: the best of each tree's runs per case (usage: swap_cmp.py OUT_DIR GPU)."""

import glob
import json
import sys


def main() -> None:
    out, gpu = sys.argv[1], sys.argv[2]
    runs: dict[tuple, dict[str, list[float]]] = {}
    for tag in ("old", "new"):
        for path in sorted(glob.glob(f"{out}/{tag}_*_{gpu}.json")):
            with open(path) as f:
                for r in json.load(f)["results"]:
                    key = (r["row_bytes"], r["buffer_size"], r["batch"], r["miss_rate"])
                    runs.setdefault(key, {}).setdefault(tag, []).append(r["us_per_call"])
    print(f"| row | D | B | miss | old us | new us | new/old |  ({gpu})")
    for key, v in sorted(runs.items()):
        old, new = min(v["old"]), min(v["new"])
        runs_old = "/".join(f"{x:.1f}" for x in v["old"])
        runs_new = "/".join(f"{x:.1f}" for x in v["new"])
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]:.0%} | {old:.1f} ({runs_old}) | {new:.1f} ({runs_new}) "
              f"| {new / old:.3f} |")


if __name__ == "__main__":
    main()
