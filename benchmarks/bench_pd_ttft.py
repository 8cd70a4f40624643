"""Time to first token of a PD request (prefill server + decode server, KV over mooncake TCP) vs colocated
serving, for one long prompt (default 4096 tokens), on tiny-dsa.

Starts four `decode-server serve` processes on 127.0.0.1: colocated HiSparse and colocated dense servers, a
prefill server and a HiSparse decode server. Requests rotate between the three set-ups, one at a time, streamed;
TTFT is the time from sending the request (PD: to both servers at once, as a router does) to the first token's
SSE chunk. Also reported: when the prefill server answered (its first token: its compute is done), so PD TTFT
minus that is what the last chunk's transfer, the aux record and decode's admission add. A short prompt warms
every path up first. Prints a Markdown table and writes JSON.

    python benchmarks/bench_pd_ttft.py                      # CPU, 4096-token prompt, 5 runs each
    python benchmarks/bench_pd_ttft.py --device cuda --prompt-tokens 8192
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
POOLS = ["--device-kv-budget", "256MiB", "--host-kv-budget", "512MiB"]
HISPARSE = ["--enable-hisparse", "--hisparse-config", '{"device_buffer_size": 128}']


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, args: list[str], device: str, context: int) -> None:
        self.name, self.port = name, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"bench-pd-{name}-", suffix=".log", delete=False)  # noqa: SIM115
        cmd = [sys.executable, "-m", "decode_server.cli", "serve", "--model-path", "tiny-dsa", "--device", device,
               "--host", "127.0.0.1", "--port", str(self.port), "--context-length", str(context), "--log-level",
               "warning", *POOLS, *args]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(REPO), MC_LOG_LEVEL="WARNING")
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{Path(self.log.name).read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} not ready after {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)


def _stream_first_token(url: str, body: dict, t0: float, out: dict, key: str) -> None:
    """POST a streamed completion; record when its first token chunk arrived (seconds after t0); drain it."""
    with httpx.Client(timeout=600) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if key not in out and line.startswith("data: {") and '"tokens":["' in line:
                out[key] = time.perf_counter() - t0
            if line.startswith("data: {") and '"error"' in line:
                raise RuntimeError(f"{url}: {line}")


def _transfer_latency(decode: Server) -> tuple[float, int]:
    d = httpx.get(decode.url + "/server_info", timeout=10).json()["stats"]["disagg"]
    return d["latency_sum_s"], d["latency_count"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--chunked-prefill-size", type=int, default=2048)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "pd_ttft.json"))
    args = ap.parse_args()
    context = args.prompt_tokens + args.max_tokens + 16
    chunk = ["--chunked-prefill-size", str(args.chunked_prefill_size)]
    bootstrap_port = _free_port()
    colocated = Server("colocated", [*HISPARSE, *chunk], args.device, context)
    colocated_dense = Server("colocated-dense", chunk, args.device, context)
    prefill = Server("prefill", ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                                 str(bootstrap_port), *chunk], args.device, context)
    decode = Server("decode", ["--disaggregation-mode", "decode", *HISPARSE, *chunk], args.device, context)
    servers = [colocated, colocated_dense, prefill, decode]
    rows: list[dict] = []
    try:
        for s in servers:
            s.wait_ready()
        for run in range(-1, args.runs):  # run -1 (a short prompt) warms every path up and is not recorded
            n = args.prompt_tokens if run >= 0 else 64
            prompt = [(run * 7919 + 31 * i) % 900 + 5 for i in range(n)]  # fresh each run
            body = {"model": "tiny-dsa", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "logprobs": 0}
            times: dict[str, float] = {}
            for server, key in ((colocated, "colocated"), (colocated_dense, "colocated_dense")):
                t0 = time.perf_counter()
                _stream_first_token(server.url, body, t0, times, key)
            pd_body = dict(body, bootstrap_host="127.0.0.1", bootstrap_port=bootstrap_port, bootstrap_room=10_000 + run)
            lat_sum, lat_n = _transfer_latency(decode)
            t0 = time.perf_counter()
            threads = [threading.Thread(target=_stream_first_token, args=(s.url, pd_body, t0, times, key))
                       for s, key in ((prefill, "prefill_done"), (decode, "pd"))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            lat_sum2, lat_n2 = _transfer_latency(decode)
            times["transfer_latency"] = (lat_sum2 - lat_sum) / max(1, lat_n2 - lat_n)
            times["pd_minus_prefill_answered"] = times["pd"] - times["prefill_done"]
            if run >= 0:
                rows.append(times)
                print(f"run {run}: colocated {times['colocated']:.3f} s (dense {times['colocated_dense']:.3f} s), PD "
                      f"{times['pd']:.3f} s (prefill answered "
                      f"{times['prefill_done']:.3f} s, room latency {times['transfer_latency']:.3f} s)", flush=True)
    finally:
        for s in servers:
            s.stop()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    ratio = med["pd"] / med["colocated"]
    print(f"\n| prompt | runs | colocated HiSparse TTFT | colocated dense TTFT | PD TTFT | PD / colocated HiSparse | "
          f"PD / colocated dense | prefill answered | PD − prefill answered |\n|---|---|---|---|---|---|---|---|---|\n"
          f"| {args.prompt_tokens} | {args.runs} | {med['colocated']:.3f} s | {med['colocated_dense']:.3f} s | "
          f"{med['pd']:.3f} s | {ratio:.3f} | {med['pd'] / med['colocated_dense']:.3f} | {med['prefill_done']:.3f} s | "
          f"{med['pd_minus_prefill_answered']:.3f} s |  (medians over runs)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "host": platform.node(),
        "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(), "args": vars(args), "runs": rows,
        "median": med, "pd_over_colocated": ratio, "pd_over_colocated_dense": med["pd"] / med["colocated_dense"],
    }, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
