"""Router-added latency (issue 11): the same streaming requests sent straight to a decode worker and through
`decode-server router`, with C concurrent streams on loopback.

By default the workers are lightweight SSE targets started by this script (`--serve-target`): each answers
like our servers (OpenAI completion chunks, usage chunk, `[DONE]`, `/health`, `/load`, `/abort_request`) with
`--tokens` chunks `--interval-ms` apart, so that the numbers measure the router and not the model. Two are
started: one plays the decode worker, the other the prefill worker (it answers with one token, as a PD prefill
server does). `--prefill-url/--decode-url` point it at real
servers instead (then `--interval-ms` is ignored).

Per request: time to the first token chunk (TTFT) and to the end of the stream (E2E), direct vs routed, and the
difference of the medians: the latency the router adds. Rounds alternate between the two paths. The router's
CPU time per routed request (from /proc) does not depend on how busy the machine is.

On a machine with many cores, give each process its own: `--router-cpus`, `--target-cpus` and `--load-cpus`
(Linux CPU lists such as `2-3` or `0,4`) pin the router, the two targets and this load generator with
sched_setaffinity, so that the router never waits for a core the load generator or a target holds.

    python benchmarks/bench_router.py --concurrency 1 64 --rounds 10 --tokens 16 --interval-ms 5
    python benchmarks/bench_router.py --concurrency 1 8 64 --router-cpus 2 --target-cpus 4-7 --load-cpus 8-11

Needs (beyond the standard library): aiohttp (the load generator; the router's client), and what the router and
the targets import: fastapi (starlette), uvicorn, pydantic, prometheus_client, uvloop, httptools.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------- the target


def serve_target(port: int, tokens_default: int, interval_ms: float, fixed_tokens: int | None) -> None:
    """A minimal OpenAI-shaped SSE worker (Starlette on uvicorn, as the real servers). `fixed_tokens` (the
    prefill target: 1) ignores the request's max_tokens, as a PD prefill server answers with one token."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def completions(request: Request) -> Response:
        body = json.loads(await request.body())
        n = fixed_tokens or int(body.get("max_tokens") or tokens_default)
        rid = body.get("rid") or "cmpl-bench"

        async def frames():  # noqa: ANN202
            for i in range(n):
                if interval_ms:
                    await asyncio.sleep(interval_ms / 1000)
                chunk = {"id": rid, "object": "text_completion", "created": 0, "model": "bench",
                         "choices": [{"index": 0, "text": f" t{i}", "logprobs": None,
                                      "finish_reason": "length" if i == n - 1 else None}], "usage": None}  # fmt: skip
                yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
            usage = {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": n + 4}
            yield "data: " + json.dumps({"id": rid, "object": "text_completion", "created": 0, "model": "bench",
                                         "choices": [], "usage": usage}, separators=(",", ":")) + "\n\n"  # fmt: skip
            yield "data: [DONE]\n\n"

        return StreamingResponse(frames(), media_type="text/event-stream")

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    async def load(_: Request) -> Response:
        return JSONResponse({"num_running_reqs": 0, "num_waiting_reqs": 0, "host_pages_free": 0})

    async def abort(_: Request) -> Response:
        return JSONResponse({"aborted": 0})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/health", health), Route("/load", load),
                            Route("/abort_request", abort, methods=["POST"])])  # fmt: skip
    # The servers' own uvicorn settings (asyncio loop, h11): the targets stand for our workers.
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, backlog=4096,
                loop="asyncio", http="h11")  # fmt: skip


# ----------------------------------------------------------------------------------------------- the client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_cpus(text: str | None) -> set[int] | None:
    """'2-3,6' -> {2, 3, 6} (the Linux CPU list syntax); None stays None (no pinning)."""
    if not text:
        return None
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pinned(cpus: set[int] | None):  # noqa: ANN201
    """A Popen preexec_fn that pins the child to `cpus` (None: no pinning)."""
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


def wait_healthy(url: str, timeout: float = 300) -> None:
    async def probe() -> bool:
        try:
            async with aiohttp.ClientSession() as s, s.get(url + "/health", timeout=aiohttp.ClientTimeout(2)) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if asyncio.run(probe()):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{url} not healthy after {timeout} s")


async def one_stream(client: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, float]:
    start = time.perf_counter()
    ttft = None
    async with client.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:  # one SSE line at a time
            if ttft is None and line.startswith(b"data: {") and b'"text"' in line:
                ttft = time.perf_counter() - start
            if line.rstrip() == b"data: [DONE]":
                break
    end = time.perf_counter() - start
    return (ttft if ttft is not None else end), end


async def run_round(url: str, concurrency: int, body: dict) -> list[tuple[float, float]]:
    """A fresh connection pool per round: min(C, 8) warm-up streams, then C streams at once."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as client:
        await asyncio.gather(*(one_stream(client, url, body) for _ in range(min(concurrency, 8))))  # warm
        return await asyncio.gather(*(one_stream(client, url, body) for _ in range(concurrency)))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64], help="one table row pair per value")
    ap.add_argument("--rounds", type=int, default=10, help="rounds per path (alternating)")
    ap.add_argument("--tokens", type=int, default=16, help="chunks per stream (max_tokens)")
    ap.add_argument("--interval-ms", type=float, default=5.0, help="target: gap between chunks")
    ap.add_argument("--prefill-url", default=None, help="a real prefill (or colocated) server instead of a target")
    ap.add_argument("--decode-url", default=None, help="a real decode (or colocated) server instead of a target")
    ap.add_argument("--model", default="tiny-dsa", help="model name sent (real servers)")
    ap.add_argument("--json", type=Path, default=None, help="write the raw numbers here")
    ap.add_argument("--router-cpus", default=None, metavar="LIST", help="pin the router to these CPUs (e.g. 2-3)")
    ap.add_argument("--target-cpus", default=None, metavar="LIST", help="pin the two targets to these CPUs")
    ap.add_argument("--load-cpus", default=None, metavar="LIST", help="pin this load generator to these CPUs")
    ap.add_argument("--serve-target", type=int, default=None, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--target-fixed-tokens", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_target is not None:
        serve_target(args.serve_target, args.tokens, args.interval_ms, args.target_fixed_tokens)
        return

    procs: list[subprocess.Popen[bytes]] = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    router_cpus, target_cpus, load_cpus = (parse_cpus(c) for c in (args.router_cpus, args.target_cpus,
                                                                   args.load_cpus))  # fmt: skip
    try:
        urls = {}
        for role, given in (("prefill", args.prefill_url), ("decode", args.decode_url)):
            if given:
                urls[role] = given.rstrip("/")
                continue
            port = free_port()
            fixed = ["--target-fixed-tokens", "1"] if role == "prefill" else []  # PD prefill: one token
            procs.append(subprocess.Popen([sys.executable, __file__, "--serve-target", str(port), "--tokens",
                                           str(args.tokens), "--interval-ms", str(args.interval_ms), *fixed],
                                          env=env, preexec_fn=pinned(target_cpus)))  # fmt: skip
            urls[role] = f"http://127.0.0.1:{port}"
        router_port = free_port()
        router_url = f"http://127.0.0.1:{router_port}"
        router_proc = subprocess.Popen([sys.executable, "-m", "decode_server.cli", "router", "--prefill",
                                       urls["prefill"], "--decode", urls["decode"], "--port", str(router_port),
                                       "--log-level", "warning", "--health-check-interval-secs", "0.5"],
                                      env=env, cwd=REPO, preexec_fn=pinned(router_cpus))  # fmt: skip
        procs.append(router_proc)
        if load_cpus is not None:
            os.sched_setaffinity(0, load_cpus)
        for url in (*urls.values(), router_url):
            wait_healthy(url)
        body = {"model": args.model, "prompt": "Benchmark", "max_tokens": args.tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        results: dict[tuple[int, str], list[tuple[float, float]]] = {}
        router_cpu: dict[int, float] = {}
        for c in args.concurrency:
            for _ in range(args.rounds):
                for path, url in (("direct", urls["decode"]), ("router", router_url)):
                    before = cpu_seconds(router_proc.pid)
                    results.setdefault((c, path), []).extend(asyncio.run(run_round(url, c, body)))
                    if path == "router":  # its CPU time per request, warm-up requests included
                        router_cpu[c] = router_cpu.get(c, 0.0) + (cpu_seconds(router_proc.pid) - before) / (
                            c + min(c, 8)) / args.rounds
        dispatch = asyncio.run(_router_dispatch_mean(router_url))
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()

    rows: dict[str, dict[str, float]] = {}
    for (c, path), samples in results.items():
        ttft = [x[0] * 1000 for x in samples]
        e2e = [x[1] * 1000 for x in samples]
        rows[f"{c}/{path}"] = {"concurrency": c, "n": len(samples), "ttft_p50": pct(ttft, 50), "ttft_p90": pct(ttft, 90),
                               "ttft_p99": pct(ttft, 99), "e2e_p50": pct(e2e, 50), "e2e_p90": pct(e2e, 90),
                               "e2e_p99": pct(e2e, 99), "e2e_mean": statistics.fmean(e2e)}  # fmt: skip
    print(f"\n{args.rounds} rounds per path and concurrency (alternating), {args.tokens} chunks per stream, target "
          f"interval {args.interval_ms:g} ms; machine: {platform.node()} ({os.cpu_count()} CPUs), load average "
          f"{os.getloadavg()[0]:.1f}; CPUs: router {args.router_cpus or 'any'}, targets {args.target_cpus or 'any'}, "
          f"load generator {args.load_cpus or 'any'}; uvloop + httptools installed: {_fast_stack()}\n")  # fmt: skip
    print("| streams | path | requests | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | E2E p50 ms | E2E p90 ms | E2E p99 ms "
          "| added p50 TTFT / E2E ms | router CPU ms / request |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    added = {}
    for c in args.concurrency:
        d, r_ = rows[f"{c}/direct"], rows[f"{c}/router"]
        added[c] = {"ttft_p50": r_["ttft_p50"] - d["ttft_p50"], "e2e_p50": r_["e2e_p50"] - d["e2e_p50"]}
        added[c]["router_cpu_ms_per_request"] = router_cpu[c] * 1000
        for path, r in (("direct", d), ("router", r_)):
            routed = path == "router"
            extra = f"{added[c]['ttft_p50']:+.2f} / {added[c]['e2e_p50']:+.2f}" if routed else ""
            cpu = f"{router_cpu[c] * 1000:.2f}" if routed else ""
            print(f"| {c} | {path} | {r['n']} | {r['ttft_p50']:.2f} | {r['ttft_p90']:.2f} | {r['ttft_p99']:.2f} | "
                  f"{r['e2e_p50']:.2f} | {r['e2e_p90']:.2f} | {r['e2e_p99']:.2f} | {extra} | {cpu} |")  # fmt: skip
    print(f"\nrouter dispatch overhead (its own metric: arrival to the worker requests going out, mean over all "
          f"requests): {dispatch * 1000:.3f} ms")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"date": datetime.now(UTC).isoformat(), "args": vars(args) | {"json": str(args.json)},
                                         "rows": rows, "added_ms": added, "dispatch_mean_s": dispatch,
                                         "load_average": os.getloadavg(), "uvloop_httptools": _fast_stack(),
                                         "python": platform.python_version()}, indent=2))  # fmt: skip


def _fast_stack() -> bool:
    """Whether the router can run on uvloop and httptools here (it falls back to asyncio and h11)."""
    return all(importlib.util.find_spec(m) is not None for m in ("uvloop", "httptools"))


async def _router_dispatch_mean(router_url: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(router_url + "/metrics", timeout=aiohttp.ClientTimeout(10)) as r:
        text = await r.text()
    vals = {}
    for line in text.splitlines():
        if line.startswith("hisparse_router:dispatch_overhead_seconds_sum"):
            vals["sum"] = float(line.split()[-1])
        elif line.startswith("hisparse_router:dispatch_overhead_seconds_count"):
            vals["count"] = float(line.split()[-1])
    return vals.get("sum", 0.0) / max(vals.get("count", 0.0), 1.0)


if __name__ == "__main__":
    main()
