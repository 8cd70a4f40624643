"""Operational helpers for images and orchestrators: `python -m decode_server.ops <command>`.

- `build-kernels`: compile the CUDA swap-in extension ahead of time for named architectures (no GPU needed;
  the CUDA image runs it at build time so that no request waits for nvcc, and the runtime needs no compiler).
- `probe [URL]`: exit 0 when GET URL answers 200 (the image's HEALTHCHECK, without curl in the image; the URL
  defaults to $DECODE_SERVER_HEALTH_URL so that one image probes whichever role it runs).
- `wait-idle URL`: poll a server's /metrics until no request runs or waits (a Kubernetes preStop hook, so a pod
  being stopped finishes its in-flight requests before SIGTERM, which aborts them).
- `check-libs [PATH ...]`: exit 1 naming every system library that a shared object under site-packages (or the
  PATHs) links but the loader cannot find (the images run it at build time; decode_server/shared_libs.py).

Standard library only (besides the kernel build), so a probe costs one interpreter start, not a torch import.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger("decode_server.ops")

# Gauges of the server's /metrics (docs/server.md) that count requests still owed an answer.
BUSY_GAUGES = ("sglang:num_running_reqs", "sglang:num_queue_reqs")
# /metrics reads the engine's stats; a busy engine on a loaded host can take seconds to answer.
SCRAPE_TIMEOUT_S = 10.0
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")


def busy_requests(metrics_text: str) -> int:
    """Sum of the BUSY_GAUGES samples (every label set) in Prometheus text format."""
    total = 0.0
    for line in metrics_text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group("name") in BUSY_GAUGES:
            total += float(match.group("value"))
    return int(total)


def _get(url: str, timeout: float) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (operator-given URL)
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def probe(url: str, timeout: float) -> int:
    try:
        status, _ = _get(url, timeout)
    except (OSError, urllib.error.URLError) as exc:
        logger.warning("probe %s: %s", url, exc)
        return 1
    if status != 200:
        logger.warning("probe %s: HTTP %d", url, status)
    return 0 if status == 200 else 1


def wait_idle(base_url: str, timeout: float, interval: float, settle: int) -> int:
    """Block until `settle` consecutive polls of /metrics see no running or queued request (exit 0), the server
    refuses connections (it is gone, nothing left to finish: exit 0), or `timeout` passes (exit 1). A scrape
    that fails otherwise (slow answer, HTTP error) counts as busy: a loaded server is not an idle one."""
    url = base_url.rstrip("/") + "/metrics"
    deadline = time.monotonic() + timeout
    quiet = 0
    busy: int | str | None = None
    while True:
        try:
            status, text = _get(url, timeout=SCRAPE_TIMEOUT_S)
            busy = busy_requests(text) if status == 200 else f"HTTP {status}"
        except (OSError, urllib.error.URLError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            if isinstance(reason, ConnectionRefusedError):
                logger.info("wait-idle: %s refuses connections: nothing left to finish", base_url)
                return 0
            busy = f"no answer ({reason})"
        quiet = quiet + 1 if busy == 0 else 0
        if quiet >= settle:
            logger.info("wait-idle: %s idle", base_url)
            return 0
        if time.monotonic() >= deadline:
            logger.warning("wait-idle: %s still busy (%s) after %.0f s", base_url, busy, timeout)
            return 1
        time.sleep(interval)


def build_kernels(archs: Sequence[str], cache_dir: Path) -> int:
    from kernels.cuda_ext import build_extension

    for arch in archs:
        library = build_extension(arch, cache_dir)
        logger.info("built %s", library)
    return 0


def check_libs(roots: Sequence[Path], allowed: Sequence[str], allow_driver: bool) -> int:
    from decode_server import shared_libs

    roots = list(roots) or shared_libs.default_roots()
    absent = [str(r) for r in roots if not r.is_dir()]
    if absent:  # a typo or a changed package layout would otherwise pass unchecked
        logger.error("check-libs: no such directory: %s", ", ".join(absent))
        return 1
    allowed = [*allowed, *(shared_libs.DRIVER_LIBRARIES if allow_driver else ())]
    report = shared_libs.check(roots, allowed)
    for line in report.lines():
        logger.error("check-libs: %s", line)
    where = ", ".join(str(r) for r in roots)
    if report.missing:
        logger.error("check-libs: %d of the %d shared objects under %s link missing libraries",
                     len({p for users in report.missing.values() for p in users}), report.checked, where)  # fmt: skip
        return 1
    logger.info("check-libs: every library linked by %d shared objects under %s resolves", report.checked, where)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m decode_server.ops", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build-kernels", help="compile the CUDA extension for the given architectures")
    b.add_argument("--arch", action="append", required=True, help="e.g. 90a (H100/H200), 100 (B200), 80 (A100)")
    b.add_argument("--cache-dir", type=Path, required=True, help="the runtime's $HISPARSE_KERNEL_CACHE")
    p = sub.add_parser("probe", help="exit 0 iff GET URL answers 200")
    p.add_argument(
        "url", nargs="?", default=os.environ.get("DECODE_SERVER_HEALTH_URL", "http://127.0.0.1:30000/health"),
        help="default: $DECODE_SERVER_HEALTH_URL, else http://127.0.0.1:30000/health",
    )
    p.add_argument("--timeout", type=float, default=5.0)
    w = sub.add_parser("wait-idle", help="wait until the server at URL has no running or queued request")
    w.add_argument("url", help="server base URL, e.g. http://127.0.0.1:30000")
    w.add_argument("--timeout", type=float, default=300.0, help="give up (exit 1) after this many seconds")
    w.add_argument("--interval", type=float, default=1.0)
    w.add_argument("--settle", type=int, default=2, help="consecutive idle polls needed")
    c = sub.add_parser("check-libs", help="exit 1 if a shared object under site-packages links a missing library")
    c.add_argument("paths", nargs="*", type=Path, help="directories to search (default: site-packages)")
    c.add_argument("--allow", action="append", default=[], metavar="SONAME", help="a library known to be absent")
    c.add_argument("--allow-driver", action="store_true",
                   help="allow the GPU driver's libraries (libcuda.so.1 ...), mounted only when a container starts")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "build-kernels":
        return build_kernels(args.arch, args.cache_dir)
    if args.command == "probe":
        return probe(args.url, args.timeout)
    if args.command == "check-libs":
        return check_libs(args.paths, args.allow, args.allow_driver)
    return wait_idle(args.url, args.timeout, args.interval, args.settle)


if __name__ == "__main__":
    sys.exit(main())
