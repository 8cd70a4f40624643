"""A free TCP port on 127.0.0.1 (nothing listens on it right after): the API harness's, below the ephemeral range
(tests/api/api_server_harness.free_port says why)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))

from api_server_harness import free_port  # noqa: E402

__all__ = ["free_port"]
