"""Transfer tests run real mooncake over TCP on 127.0.0.1 (`make test` installs it: pyproject's `pd` extra plus
libibverbs1, libnuma1 and libcurl4 through the Makefile). No skip when it is missing: a missing transfer engine is a failed install."""

from __future__ import annotations

import os

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
