"""Scratch: where a 20 %-miss step loses time against the 0 % one (Chrome traces of bench_decode --profile-dir)."""
import collections
import json
import sys


def load(path):
    with open(path) as f:
        ev = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    ev.sort(key=lambda e: e["ts"])
    return ev


def short(name):
    return name[:70]


def analyze(path, steps=2):
    ev = load(path)
    by_stream = collections.defaultdict(list)
    for e in ev:
        by_stream[e["args"].get("stream", e.get("tid"))].append(e)
    main = max(by_stream, key=lambda s: len(by_stream[s]))
    t0, t1 = ev[0]["ts"], max(e["ts"] + e["dur"] for e in ev)
    print(f"== {path}: span {(t1 - t0) / steps:.0f} us/step")
    for s, es in by_stream.items():
        print(f"  stream {s}{' (main)' if s == main else ''}: {len(es) / steps:.0f} kernels, busy {sum(e['dur'] for e in es) / steps:.0f} us/step")
    m = by_stream[main]
    gaps = []
    for a, b in zip(m, m[1:], strict=False):
        g = b["ts"] - (a["ts"] + a["dur"])
        if g > 3:
            gaps.append((g, short(a["name"]), short(b["name"]), a["ts"] + a["dur"] - t0))
    print(f"  main idle > 3 us: {sum(g[0] for g in gaps) / steps:.0f} us/step in {len(gaps)} gaps; largest:")
    for g in sorted(gaps, reverse=True)[:12]:
        print(f"    {g[0]:7.1f} us at {g[3]:8.1f} after {g[1]} -> before {g[2]}")
    tot = collections.Counter()
    for e in m:
        tot[short(e["name"])] += e["dur"] / steps
    side = [e for s, es in by_stream.items() if s != main for e in es]
    print("  side-stream kernels (first step):")
    for e in side[: max(1, len(side) // steps)]:
        print(f"    {e['ts'] - t0:8.1f} +{e['dur']:7.1f} {short(e['name'])}")
    return tot


a = analyze(sys.argv[1])
b = analyze(sys.argv[2])
print("== main-stream kernel time, 0 % -> 20 % (us/step), largest changes")
rows = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0) - a.get(k, 0)))
for k in rows[:25]:
    print(f"  {a.get(k, 0):8.1f} -> {b.get(k, 0):8.1f}  {k}")
print(f"  total {sum(a.values()):.0f} -> {sum(b.values()):.0f}")
