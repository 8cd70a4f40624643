"""Router-added latency (issue 11): the same streaming requests sent straight to a decode worker and through
`decode-server router`, with C concurrent streams on loopback.

By default the workers are lightweight SSE targets started by this script (`--serve-target`): each answers
like our servers (OpenAI completion chunks, usage chunk, `[DONE]`, `/health`, `/load`, `/abort_request`) with
`--tokens` chunks `--interval-ms` apart, so that the numbers measure the router and not the model. Two are
started: one plays the decode worker, the other the prefill worker (it answers with one token, as a PD prefill
server does). `--prefill-url/--decode-url` point it at real
servers instead (then `--interval-ms` is ignored).

Per request: time to the first token chunk (TTFT) and to the end of the stream (E2E), direct vs routed, and the
difference of the medians: the latency the router adds. Rounds alternate between the two paths. Two load shapes
(`--pattern`): `burst` releases C streams at once (every request of the burst queues behind the others' router
work: the worst case), `steady` keeps C streams in flight for `--steady-seconds` (each of C slots sends its next
request when its last one ends: C concurrent streams whose arrivals are spread out, as in a service under load). The router's
CPU time per routed request (from /proc) does not depend on how busy the machine is.

`--router-processes 1 4` measures one router per value, one after the other, against the same targets (the
router's `--router-processes`); the last table compares them.

On a machine with many cores, give each part its own: `--router-cpus`, `--target-cpus` and `--load-cpus` (Linux
CPU lists such as `2-3` or `0,4`) pin the router, the targets and the load generator with sched_setaffinity, so
that the router never waits for a core the load generator or a target holds. A router of N processes is pinned
to the first N CPUs of `--router-cpus` (all of them if the list is shorter), so `--router-cpus 0-3
--router-processes 1 4` compares one process on one core with four on four. With `--load-cpus`, the load comes
from one process per listed CPU (`--load-processes`), each pinned to its CPU and sending its share of the C
streams, all released at once by a barrier after their warm-up: one Python process parsing 64 streams' SSE would
itself be a queue in front of the numbers. With `--target-cpus`, each target runs as one process per two listed
CPUs (`--target-processes`), sharing its port through SO_REUSEPORT.

    python benchmarks/bench_router.py --concurrency 1 64 --rounds 10 --tokens 16 --interval-ms 5
    python benchmarks/bench_router.py --concurrency 1 8 64 --router-processes 1 4 --router-cpus 0-3 \
        --target-cpus 4-7 --load-cpus 8-15

Needs (beyond the standard library): aiohttp (the load generator; the router's client), and what the router and
the targets import: fastapi (starlette), uvicorn, pydantic, prometheus_client, uvloop, httptools.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import multiprocessing
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

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
    # The servers' own uvicorn settings (asyncio loop, h11): the targets stand for our workers. Several target
    # processes of one role share the port (SO_REUSEPORT), so the socket is made here. IPPROTO_TCP explicitly:
    # asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and with Nagle on the first chunk after the
    # headers would wait ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(4096)
    config = uvicorn.Config(app, log_level="warning", access_log=False, backlog=4096, loop="asyncio", http="h11")
    uvicorn.Server(config).run(sockets=[sock])


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


def split(total: int, parts: int) -> list[int]:
    """`total` as evenly as possible over `parts` (the first ones get the remainder)."""
    return [total // parts + (i < total % parts) for i in range(parts)]


async def run_share(url: str, streams: int, warm: int, body: dict, conn: Any = None,
                    seconds: float = 0.0) -> tuple[list[tuple[float, float]], int]:  # fmt: skip
    """A fresh connection pool: `warm` streams, then `streams` at once; returns their samples and how many requests
    were sent in all. `seconds` > 0 (steady pattern): each of the `streams` slots sends its next request as soon
    as its last one ended, for `seconds`, and the first request of each slot is not counted (it opens the slot's
    connection). In a load process, `conn` is its pipe to the coordinator: "warm" goes up once warmed, and the
    streams start when "go" comes back (after every load process is warm, so that all of them start together)."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)

    async def slot(client: aiohttp.ClientSession) -> list[tuple[float, float]]:
        end = time.monotonic() + seconds
        samples = [await one_stream(client, url, body)]
        while time.monotonic() < end:
            samples.append(await one_stream(client, url, body))
        return samples

    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as client:
        await asyncio.gather(*(one_stream(client, url, body) for _ in range(warm)))
        if conn is not None:
            conn.send("warm")
            assert conn.recv() == "go"  # blocks this loop: nothing else runs in it now
        if seconds <= 0:
            return list(await asyncio.gather(*(one_stream(client, url, body) for _ in range(streams)))), warm + streams
        per_slot = await asyncio.gather(*(slot(client) for _ in range(streams)))
        return [x for samples in per_slot for x in samples[1:]], warm + sum(len(x) for x in per_slot)


def _run(coro: Any) -> Any:
    """asyncio.run on uvloop when it is installed (the load generator should cost as little as it can)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _load_process(conn: Any, cpu: int | None) -> None:
    """One load process: pinned to `cpu`, runs its share of each round it is sent, until it gets None."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    while (task := conn.recv()) is not None:
        url, streams, warm, body, seconds = task
        conn.send(_run(run_share(url, streams, warm, body, conn, seconds)))


class LoadGenerator:
    """C streams per round from `processes` processes (in this one when 1), each pinned to one of `cpus`.

    The processes are started once (spawn: a clean interpreter each) and coordinated over pipes (no semaphore:
    multiprocessing's need /dev/shm, which some containers lack)."""

    def __init__(self, processes: int, cpus: list[int] | None) -> None:
        self.processes = processes
        self.conns: list[Any] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        if processes == 1:
            return
        ctx = multiprocessing.get_context("spawn")
        for i in range(processes):
            parent, child = ctx.Pipe()
            cpu = cpus[i % len(cpus)] if cpus else None
            proc = ctx.Process(target=_load_process, args=(child, cpu), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def round(self, url: str, concurrency: int, body: dict, seconds: float) -> tuple[list[tuple[float, float]], int]:
        """min(C, 8) warm-up streams, then C streams at once, or (seconds > 0) C streams kept going for that long
        (both split over the load processes); the samples and the number of requests sent."""
        warm = min(concurrency, 8)
        if self.processes == 1:
            return _run(run_share(url, concurrency, warm, body, None, seconds))
        for conn, streams, w in zip(self.conns, split(concurrency, self.processes), split(warm, self.processes),
                                    strict=True):  # fmt: skip
            conn.send((url, streams, w, body, seconds))
        for conn in self.conns:
            if conn.recv() != "warm":
                raise RuntimeError("a load process failed during its warm-up")
        for conn in self.conns:
            conn.send("go")
        shares = [conn.recv() for conn in self.conns]
        return [x for samples, _ in shares for x in samples], sum(sent for _, sent in shares)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of processes so far (Linux /proc)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return found


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


@dataclass
class RouterRun:
    """The measurements of one router configuration."""

    processes: int
    cpus: str
    results: dict[tuple[str, str], list[tuple[float, float]]]  # (case, path) -> samples
    router_cpu: dict[str, float]  # seconds of router CPU per routed request, by case
    dispatch: float  # the router's own dispatch-overhead metric, mean


@dataclass(frozen=True)
class Case:
    """One load shape: `burst` (C streams released at once) or `steady` (C streams kept in flight)."""

    pattern: str
    concurrency: int

    @property
    def label(self) -> str:
        return f"{self.pattern} {self.concurrency}"


def rows_of(run: RouterRun, cases: list[Case]) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    rows: dict[str, dict[str, float]] = {}
    for (label, path), samples in run.results.items():
        ttft = [x[0] * 1000 for x in samples]
        e2e = [x[1] * 1000 for x in samples]
        rows[f"{label}/{path}"] = {"n": len(samples), "ttft_p50": pct(ttft, 50), "ttft_p90": pct(ttft, 90),
                                   "ttft_p99": pct(ttft, 99), "e2e_p50": pct(e2e, 50), "e2e_p90": pct(e2e, 90),
                                   "e2e_p99": pct(e2e, 99), "e2e_mean": statistics.fmean(e2e)}  # fmt: skip
    added = {}
    for case in cases:
        d, r = rows[f"{case.label}/direct"], rows[f"{case.label}/router"]
        added[case.label] = {"ttft_p50": r["ttft_p50"] - d["ttft_p50"], "e2e_p50": r["e2e_p50"] - d["e2e_p50"],
                             "router_cpu_ms_per_request": run.router_cpu[case.label] * 1000}  # fmt: skip
    return rows, added


def measure_router(args: argparse.Namespace, cases: list[Case], urls: dict[str, str], processes: int,
                   cpus: list[int] | None, load: LoadGenerator, env: dict[str, str],
                   everywhere: set[int]) -> RouterRun:  # fmt: skip
    """Start a router of `processes` processes on `cpus`, run every round against it and the direct path."""
    port = free_port()
    router_url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "decode_server.cli", "router", "--prefill", urls["prefill"],
                             "--decode", urls["decode"], "--port", str(port), "--log-level", "warning",
                             "--health-check-interval-secs", "0.5", "--router-processes", str(processes)],
                            env=env, cwd=REPO, preexec_fn=pinned(set(cpus) if cpus else everywhere))  # fmt: skip
    try:
        wait_healthy(router_url)
        pids = [proc.pid]
        deadline = time.monotonic() + 60
        while processes > 1 and len(pids) < processes + 1 and time.monotonic() < deadline:
            pids = [proc.pid, *child_pids(proc.pid)]
            time.sleep(0.1)
        body = {"model": args.model, "prompt": "Benchmark", "max_tokens": args.tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        cpu_used: dict[str, float] = {}
        sent: dict[str, int] = {}
        for case in cases:
            seconds = args.steady_seconds if case.pattern == "steady" else 0.0
            for _ in range(args.rounds if case.pattern == "burst" else args.steady_rounds):
                for path, url in (("direct", urls["decode"]), ("router", router_url)):
                    before = cpu_seconds(pids)
                    samples, requests = load.round(url, case.concurrency, body, seconds)
                    results.setdefault((case.label, path), []).extend(samples)
                    if path == "router":  # its CPU time per request, warm-up requests included
                        cpu_used[case.label] = cpu_used.get(case.label, 0.0) + cpu_seconds(pids) - before
                        sent[case.label] = sent.get(case.label, 0) + requests
        router_cpu = {label: cpu_used[label] / sent[label] for label in cpu_used}
        dispatch = asyncio.run(_router_dispatch_mean(router_url))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    text = ",".join(map(str, cpus)) if cpus else "any"
    return RouterRun(processes, text, results, router_cpu, dispatch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64], help="one table row pair per value")
    ap.add_argument("--pattern", nargs="+", choices=["burst", "steady"], default=["burst"],
                    help="burst: C streams released at once (after a warm-up of min(C, 8)), the worst case for "
                         "queueing; steady: C streams kept in flight (each slot sends its next request when its "
                         "last one ends) for --steady-seconds, i.e. C concurrent streams arriving spread out")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=10, help="burst rounds per path (alternating)")
    ap.add_argument("--steady-rounds", type=int, default=3, help="steady rounds per path (alternating)")
    ap.add_argument("--steady-seconds", type=float, default=3.0, help="length of one steady round")
    ap.add_argument("--tokens", type=int, default=16, help="chunks per stream (max_tokens)")
    ap.add_argument("--interval-ms", type=float, default=5.0, help="target: gap between chunks")
    ap.add_argument("--router-processes", type=int, nargs="+", default=[1], metavar="N",
                    help="the router's --router-processes; one router per value, measured one after the other")
    ap.add_argument("--prefill-url", default=None, help="a real prefill (or colocated) server instead of a target")
    ap.add_argument("--decode-url", default=None, help="a real decode (or colocated) server instead of a target")
    ap.add_argument("--model", default="tiny-dsa", help="model name sent (real servers)")
    ap.add_argument("--json", type=Path, default=None, help="write the raw numbers here")
    ap.add_argument("--router-cpus", default=None, metavar="LIST",
                    help="pin the router to these CPUs (e.g. 0-3; N processes: the first N of them)")
    ap.add_argument("--target-cpus", default=None, metavar="LIST", help="pin the targets to these CPUs")
    ap.add_argument("--load-cpus", default=None, metavar="LIST", help="pin the load generator to these CPUs")
    ap.add_argument("--load-processes", type=int, default=None,
                    help="load generator processes (default: one per --load-cpus CPU, else 1)")
    ap.add_argument("--target-processes", type=int, default=None,
                    help="processes per target (default: one per two --target-cpus CPUs, else 1)")
    ap.add_argument("--serve-target", type=int, default=None, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--target-fixed-tokens", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_target is not None:
        serve_target(args.serve_target, args.tokens, args.interval_ms, args.target_fixed_tokens)
        return

    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so that the `finally` below stops the targets.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    procs: list[subprocess.Popen[bytes]] = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    router_cpus, target_cpus, load_cpus = (parse_cpus(c) for c in (args.router_cpus, args.target_cpus,
                                                                   args.load_cpus))  # fmt: skip
    load_processes = args.load_processes or (len(load_cpus) if load_cpus else 1)
    target_processes = args.target_processes or (max(1, len(target_cpus) // 2) if target_cpus else 1)
    everywhere = os.sched_getaffinity(0)  # for what is not pinned (this process may be pinned below)
    if load_cpus is not None:
        os.sched_setaffinity(0, load_cpus)
    load = LoadGenerator(load_processes, sorted(load_cpus) if load_cpus else None)
    runs: list[RouterRun] = []
    try:
        urls = {}
        for role, given in (("prefill", args.prefill_url), ("decode", args.decode_url)):
            if given:
                urls[role] = given.rstrip("/")
                continue
            port = free_port()
            fixed = ["--target-fixed-tokens", "1"] if role == "prefill" else []  # PD prefill: one token
            for _ in range(target_processes):
                procs.append(subprocess.Popen([sys.executable, __file__, "--serve-target", str(port), "--tokens",
                                               str(args.tokens), "--interval-ms", str(args.interval_ms), *fixed],
                                              env=env, preexec_fn=pinned(target_cpus or everywhere)))  # fmt: skip
            urls[role] = f"http://127.0.0.1:{port}"
        for url in urls.values():
            wait_healthy(url)
        cases = [Case(pattern, c) for pattern in args.pattern for c in args.concurrency]
        for n in args.router_processes:
            cpus = sorted(router_cpus)[: max(n, 1)] if router_cpus else None
            runs.append(measure_router(args, cases, urls, n, cpus, load, env, everywhere))
    finally:
        with contextlib.suppress(Exception):  # whatever happened, the targets must not outlive this script
            load.close()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()

    print(f"\nburst: {args.rounds} rounds per path, steady: {args.steady_rounds} rounds of {args.steady_seconds:g} s "
          f"per path (alternating direct/router); {args.tokens} chunks per stream, target interval "
          f"{args.interval_ms:g} ms; machine: {platform.node()} ({os.cpu_count()} CPUs), load average "
          f"{os.getloadavg()[0]:.1f}; CPUs: router {args.router_cpus or 'any'}, targets {args.target_cpus or 'any'} "
          f"({target_processes} process(es) each), load generator {args.load_cpus or 'any'} ({load_processes} "
          f"process(es)); uvloop + httptools installed: {_fast_stack()}")  # fmt: skip
    summary = []
    configs = []
    for run in runs:
        rows, added = rows_of(run, cases)
        print(f"\nrouter: {run.processes} process(es) on CPUs {run.cpus}\n")
        print("| load | path | requests | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | E2E p50 ms | E2E p90 ms "
              "| E2E p99 ms | added p50 TTFT / E2E ms | router CPU ms / request |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for case in cases:
            a = added[case.label]
            for path in ("direct", "router"):
                r = rows[f"{case.label}/{path}"]
                routed = path == "router"
                extra = f"{a['ttft_p50']:+.2f} / {a['e2e_p50']:+.2f}" if routed else ""
                cpu = f"{a['router_cpu_ms_per_request']:.2f}" if routed else ""
                print(f"| {case.label} | {path} | {r['n']} | {r['ttft_p50']:.2f} | {r['ttft_p90']:.2f} | "
                      f"{r['ttft_p99']:.2f} | {r['e2e_p50']:.2f} | {r['e2e_p90']:.2f} | {r['e2e_p99']:.2f} | {extra} "
                      f"| {cpu} |")  # fmt: skip
            d, r = rows[f"{case.label}/direct"], rows[f"{case.label}/router"]
            summary.append(f"| {run.processes} | {run.cpus} | {case.label} | {d['ttft_p50']:.2f} | {r['ttft_p50']:.2f} "
                           f"| {a['ttft_p50']:+.2f} / {a['e2e_p50']:+.2f} | {a['router_cpu_ms_per_request']:.2f} | "
                           f"{run.dispatch * 1000:.3f} |")  # fmt: skip
        configs.append({"router_processes": run.processes, "router_cpus": run.cpus, "rows": rows,
                        "added_ms": added, "dispatch_mean_s": run.dispatch})  # fmt: skip
    print("\nsummary (added = router p50 - direct p50; dispatch = the router's own arrival-to-requests-sent mean)\n")
    print("| router processes | router CPUs | load (streams) | direct TTFT p50 ms | router TTFT p50 ms | added p50 TTFT "
          "/ E2E ms | router CPU ms / request | dispatch ms |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(summary))
    if args.json:
        args.json.write_text(json.dumps({"date": datetime.now(UTC).isoformat(), "args": vars(args) | {"json": str(args.json)},
                                         "load_processes": load_processes, "target_processes": target_processes,
                                         "configs": configs, "load_average": os.getloadavg(),
                                         "uvloop_httptools": _fast_stack(), "python": platform.python_version(),
                                         "cpus": os.cpu_count()}, indent=2))  # fmt: skip


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
