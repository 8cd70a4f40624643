"""The router is a plain HTTP proxy: importing it (and starting `decode-server router`/`up`) needs no torch."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import sys
import decode_server.cli, decode_server.up
import decode_server.router.server, decode_server.router.app, decode_server.router.proxy
import decode_server.router.supervisor, decode_server.router.child
heavy = sorted(m for m in sys.modules
               if m == "torch" or m.startswith(("torch.", "decode_server.engine", "decode_server.model")))
print(heavy)
"""


def test_router_imports_no_torch_no_engine() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
