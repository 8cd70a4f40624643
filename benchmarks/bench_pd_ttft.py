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
    # the cost of the PD control plane's authentication (issue 25): two PD pairs, one with a cluster secret,
    # requests alternating between them (the router's room ticket is made here, as the router makes it)
    python benchmarks/bench_pd_ttft.py --auth both --skip-colocated --prompt-tokens 512 --runs 11

With `--auth on|both` the JSON also holds the CPU time of the authentication work one PD request costs
(`auth_cpu_us_per_request`: two sealed and opened control frames, one ticket signed and verified twice).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
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


def _auth_cpu_us_per_request(auth: object, n: int = 2000) -> float:
    """CPU time (µs) of the authentication work of one PD request once the peers know each other: the ROOM and
    the STATUS frame sealed, opened and checked for replay, and the router's ticket signed once and verified by
    both servers."""
    from transfer.auth import PDAuth, ReplayGuard
    from transfer.messages import RoomRequest, Status, decode_envelope, encode

    assert isinstance(auth, PDAuth)
    guard = ReplayGuard(auth.window_s)
    room = RoomRequest(secrets.randbits(128), "127.0.0.1:15000", 512, 3, RoomRequest.pack_rows(list(range(512))))
    t0 = time.process_time()
    for _ in range(n):
        for msg in (room, Status(room.room, True, dest_digest=bytes(32))):
            frame = auth.seal(encode(msg, "tcp://127.0.0.1:1", envelope=PDAuth.envelope("tcp://127.0.0.1:2")))
            _, _, env = decode_envelope(auth.open(frame))
            guard.check(env["ts"], env["nonce"])
        ticket = auth.sign_ticket("127.0.0.1", 8998, room.room)
        auth.verify_ticket(ticket, "127.0.0.1", 8998, room.room)
        auth.verify_ticket(ticket, "127.0.0.1", 8998, room.room)
    return (time.process_time() - t0) / n * 1e6


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
    ap.add_argument("--auth", choices=["off", "on", "both"], default="off",
                    help="PD pair with a cluster secret (on), without (off), or one of each, alternating (both)")
    ap.add_argument("--skip-colocated", action="store_true", help="PD pair(s) only")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "pd_ttft.json"))
    args = ap.parse_args()
    context = args.prompt_tokens + args.max_tokens + 16
    chunk = ["--chunked-prefill-size", str(args.chunked_prefill_size)]
    bootstrap_port = _free_port()
    from transfer.auth import PDAuth

    secret_dir = tempfile.mkdtemp(prefix="bench-pd-auth-")
    secret_file = os.path.join(secret_dir, "secret")
    with open(os.open(secret_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(secrets.token_bytes(32).hex())
    auth = PDAuth.from_file(secret_file)
    colocated = colocated_dense = None
    servers: list[Server] = []
    if not args.skip_colocated:
        colocated = Server("colocated", [*HISPARSE, *chunk], args.device, context)
        colocated_dense = Server("colocated-dense", chunk, args.device, context)
        servers += [colocated, colocated_dense]
    pairs: list[tuple[str, Server, Server, int, PDAuth | None]] = []  # (key, prefill, decode, bootstrap port, auth)
    for mode in (["off", "on"] if args.auth == "both" else [args.auth]):
        key = "pd" if args.auth != "both" else f"pd_auth_{mode}"
        extra = ["--disaggregation-auth-secret-file", secret_file] if mode == "on" else []
        bootstrap_port = _free_port()
        prefill = Server(f"prefill-{mode}", ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                                             str(bootstrap_port), *chunk, *extra], args.device, context)
        decode = Server(f"decode-{mode}", ["--disaggregation-mode", "decode", *HISPARSE, *chunk, *extra],
                        args.device, context)
        servers += [prefill, decode]
        pairs.append((key, prefill, decode, bootstrap_port, auth if mode == "on" else None))
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
            if colocated is not None and colocated_dense is not None:
                for server, key in ((colocated, "colocated"), (colocated_dense, "colocated_dense")):
                    t0 = time.perf_counter()
                    _stream_first_token(server.url, body, t0, times, key)
            # with two pairs, which goes first alternates from run to run (a drift in load hits both alike)
            for key, prefill, decode, bootstrap_port, pair_auth in (pairs if run % 2 else pairs[::-1]):
                room = secrets.randbits(128)  # as the router draws rooms
                pd_body = dict(body, bootstrap_host="127.0.0.1", bootstrap_port=bootstrap_port, bootstrap_room=room)
                lat_sum, lat_n = _transfer_latency(decode)
                t0 = time.perf_counter()
                if pair_auth is not None:  # the router's ticket, made here as the router makes it (in the timing)
                    pd_body["bootstrap_auth"] = pair_auth.sign_ticket("127.0.0.1", bootstrap_port, room)
                threads = [threading.Thread(target=_stream_first_token, args=(s.url, pd_body, t0, times, k))
                           for s, k in ((prefill, f"{key}_prefill_done"), (decode, key))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                lat_sum2, lat_n2 = _transfer_latency(decode)
                times[f"{key}_transfer_latency"] = (lat_sum2 - lat_sum) / max(1, lat_n2 - lat_n)
                times[f"{key}_minus_prefill_answered"] = times[key] - times[f"{key}_prefill_done"]
            if run >= 0:
                rows.append(times)
                print(f"run {run}: " + ", ".join(f"{k} {v:.3f} s" for k, v in times.items()), flush=True)
    finally:
        for s in servers:
            s.stop()
        os.unlink(secret_file)
        os.rmdir(secret_dir)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    result: dict = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "host": platform.node(),
                    "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(), "args": vars(args), "runs": rows,
                    "median": med}  # fmt: skip
    if colocated is not None and "pd" in med:
        ratio = med["pd"] / med["colocated"]
        result.update(pd_over_colocated=ratio, pd_over_colocated_dense=med["pd"] / med["colocated_dense"])
        print(f"\n| prompt | runs | colocated HiSparse TTFT | colocated dense TTFT | PD TTFT | PD / colocated HiSparse | "
              f"PD / colocated dense | prefill answered | PD − prefill answered |\n|---|---|---|---|---|---|---|---|---|\n"
              f"| {args.prompt_tokens} | {args.runs} | {med['colocated']:.3f} s | {med['colocated_dense']:.3f} s | "
              f"{med['pd']:.3f} s | {ratio:.3f} | {med['pd'] / med['colocated_dense']:.3f} | "
              f"{med['pd_prefill_done']:.3f} s | {med['pd_minus_prefill_answered']:.3f} s |  (medians over runs)")
    if args.auth != "off":
        result["auth_cpu_us_per_request"] = _auth_cpu_us_per_request(auth)
        print(f"authentication CPU per PD request (2 frames sealed+opened, 1 ticket signed + 2 verified): "
              f"{result['auth_cpu_us_per_request']:.1f} µs")
    if args.auth == "both":
        on, off = med["pd_auth_on"], med["pd_auth_off"]
        per_run = sorted(r["pd_auth_on"] / r["pd_auth_off"] for r in rows)
        result["pd_auth_on_over_off"] = on / off
        result["per_run_ratio_median"] = statistics.median(per_run)
        print(f"\n| prompt | runs | PD TTFT, auth off | PD TTFT, auth on | on / off (medians) | on / off per run: "
              f"median (min–max) |\n|---|---|---|---|---|---|\n| {args.prompt_tokens} | {args.runs} | {off:.3f} s | "
              f"{on:.3f} s | {on / off:.4f} | {statistics.median(per_run):.4f} ({per_run[0]:.3f}–{per_run[-1]:.3f}) |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
