"""The api process never needs torch: importing its modules and the tokenizer must not pull it in."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import sys
import decode_server.api.app, decode_server.api.server, decode_server.api.serving, decode_server.api.metrics
from decode_server.model import Tokenizer  # noqa: F401
heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print(len(heavy))
"""


def test_api_modules_do_not_import_torch() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "0", out.stdout + out.stderr
