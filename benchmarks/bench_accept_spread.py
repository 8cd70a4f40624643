"""Which process accepts a burst of connections: one listening socket shared by N processes (uvicorn `--workers`,
gunicorn) vs one SO_REUSEPORT socket per process (what `decode-server router --router-processes N` does).

N uvloop processes accept and hold connections for a moment (a little work each); this script starts C connects
at once and prints, per layout, how many each process accepted (sorted). The router's choice rests on the
spread: with a shared socket the first process to wake accepts whatever is queued.

    python benchmarks/bench_accept_spread.py --processes 4 --connections 64 --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import socket
import time
from typing import Any

import uvloop


def _serve(sock: socket.socket, results: Any, seconds: float) -> None:
    accepted = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        await asyncio.sleep(0.002)  # a little work per connection, as a router has
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handler, sock=sock)
        await asyncio.sleep(seconds)
        server.close()

    uvloop.run(main())
    results.put(accepted)


def _socket(reuse_port: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return sock


def _connect_all(port: int, connections: int) -> list[socket.socket]:
    """`connections` non-blocking connects started at once (a burst), not one after the other."""
    clients = []
    for _ in range(connections):
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        client.setblocking(False)
        client.connect_ex(("127.0.0.1", port))
        clients.append(client)
    return clients


def spread(layout: str, processes: int, connections: int) -> list[int]:
    """Connections accepted by each process (sorted), for layout "shared" or "reuseport"."""
    ctx = multiprocessing.get_context("fork")  # the sockets go to the children as they are
    results = ctx.Queue()
    if layout == "shared":
        sock = _socket(False)
        sock.bind(("127.0.0.1", 0))
        sock.listen(4096)
        sockets = [sock] * processes
    else:
        sockets, port = [], 0
        for _ in range(processes):
            sock = _socket(True)
            sock.bind(("127.0.0.1", port))
            port = sock.getsockname()[1]
            sock.listen(4096)
            sockets.append(sock)
    port = sockets[0].getsockname()[1]
    procs = [ctx.Process(target=_serve, args=(s, results, 3.0)) for s in sockets]
    for p in procs:
        p.start()
    time.sleep(1.0)  # every process is waiting in accept
    clients = _connect_all(port, connections)
    time.sleep(1.5)
    for client in clients:
        client.close()
    counts = sorted(results.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(10)
    for s in set(sockets):
        s.close()
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    for run in range(args.runs):
        for layout in ("shared", "reuseport"):
            print(f"run {run + 1}, {layout}: {spread(layout, args.processes, args.connections)}")


if __name__ == "__main__":
    main()
