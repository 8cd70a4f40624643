"""One router process of several: `python -m decode_server.router.child` (started by `supervisor.py` only).

It gets a listening socket and a readiness pipe as inherited descriptors, its config as JSON in the environment
(`HISPARSE_ROUTER_CONFIG`, removed once read) and the shared metrics directory in `PROMETHEUS_MULTIPROC_DIR`, then
runs the same server as the single-process router. It dies with the supervisor (parent-death signal) and ignores
SIGINT (the supervisor passes a terminal's Ctrl-C on as SIGTERM; see `server.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """SIGTERM when the supervisor dies, however it dies (SIGKILL included): no orphaned router process."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # it died before the signal was armed
        sys.exit(1)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--listen-fd", type=int, required=True)
    p.add_argument("--ready-fd", type=int, required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(args.parent_pid)

    from decode_server.router.supervisor import CONFIG_ENV, READY

    metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    config_json = os.environ.pop(CONFIG_ENV, None)
    if not metrics_dir or config_json is None:
        print("decode_server.router.child is started by the router's supervisor only", file=sys.stderr)
        return 2

    from decode_server.router.config import RouterConfig
    from decode_server.router.server import ChildContext, run

    config = RouterConfig.model_validate_json(config_json)
    logging.basicConfig(level=config.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s router[{args.index}] %(name)s: %(message)s")  # fmt: skip

    def on_ready() -> None:
        with contextlib.suppress(OSError):  # a supervisor that is gone learns nothing either way
            os.write(args.ready_fd, READY)
            os.close(args.ready_fd)

    sock = socket.socket(fileno=args.listen_fd)
    return run(config, ChildContext(args.index, sock, metrics_dir, on_ready))


if __name__ == "__main__":
    sys.exit(main())
