# ruff: noqa  -- kept as it ran (scratch analysis)
"""Where glm5-rank-ep8's 20 %-miss step (prefetch on, 16 capped copy blocks) loses time against the 0 % one,
from call 2's traces: each kernel matched to its occurrence in the 0 % trace (by name and order), split by whether it
ran beside a follower's capped copy (`swap_in_copy_kernel<4>`, > 50 % overlap). CUDA-graph replays spread kernels
over the graph's internal streams, so the side copies are found by name, not by stream.
Run: python3 trace_beside_copy.py m0_trace.json.gz m20_trace.json.gz"""
import collections
import gzip
import json
import sys

steps=2
def load(f):
    ev=[e for e in json.load(gzip.open(f))["traceEvents"] if e.get("cat")=="kernel"]
    ev.sort(key=lambda e:e["ts"]); return ev
a=load(sys.argv[1]); b=load(sys.argv[2])
def span(ev): return (max(e["ts"]+e["dur"] for e in ev)-ev[0]["ts"])/steps
print("span", span(a), span(b))
side=lambda e: "swap_in_copy_kernel<4>" in e["name"]
sb=[e for e in b if side(e)]
print("side copies per step", len(sb)/steps, "busy us", sum(e["dur"] for e in sb)/steps, "mean", sum(e["dur"] for e in sb)/len(sb))
own=[e for e in b if "swap_in_copy_kernel<1>" in e["name"]]
print("own copies", len(own)/steps, "busy", sum(e["dur"] for e in own)/steps, "mean", sum(e["dur"] for e in own)/len(own))
# union of side intervals
iv=sorted((e["ts"],e["ts"]+e["dur"]) for e in sb)
def ov(e):
    x,y=e["ts"],e["ts"]+e["dur"]; t=0
    for s,t2 in iv:
        if s>=y: break
        lo,hi=max(x,s),min(y,t2)
        if hi>lo: t+=hi-lo
    return t/max(e["dur"],1e-9)
base=collections.defaultdict(list)
for e in a:
    if not side(e): base[e["name"]].append(e["dur"])
seen=collections.Counter()
agg=collections.defaultdict(lambda:[0,0,0,0,0])  # name -> base_beside, new_beside, base_alone, new_alone, n_beside
for e in b:
    if side(e): continue
    i=seen[e["name"]]; seen[e["name"]]+=1
    bd=base[e["name"]][i] if i<len(base[e["name"]]) else 0
    k=e["name"][:70]
    if ov(e)>0.5: agg[k][0]+=bd/steps; agg[k][1]+=e["dur"]/steps; agg[k][4]+=1/steps
    else: agg[k][2]+=bd/steps; agg[k][3]+=e["dur"]/steps
tb=sum(v[0] for v in agg.values()); nb=sum(v[1] for v in agg.values())
ta=sum(v[2] for v in agg.values()); na=sum(v[3] for v in agg.values())
print(f"beside: {tb:.0f} -> {nb:.0f}  alone: {ta:.0f} -> {na:.0f}")
for k,v in sorted(agg.items(), key=lambda kv:-(kv[1][1]-kv[1][0]+kv[1][3]-kv[1][2]))[:25]:
    print(f"{v[0]:8.0f}->{v[1]:8.0f} (x{v[4]:4.0f}) | {v[2]:8.0f}->{v[3]:8.0f}  {k}")
