"""How a child process of the server lives and dies: it dies with its parent, and leaves Ctrl-C to it.

Every engine process, every rank of a rank group and the api's tokenizer workers are children that must not
outlive the process that started them: Linux's parent-death signal kills them however the parent dies, and the
loops also check their parent pid. The parent owns Ctrl-C (a terminal sends SIGINT to the whole process group)
and stops its children itself, over their sockets or by ending them.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import signal
import sys
from typing import Any

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL us when the parent process dies, however it dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def leave_signals_to_parent() -> None:
    """SIGINT is ignored (the parent decides when we stop); SIGTERM exits cleanly (`sys.exit(0)`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))


def load_factory(spec: str) -> Any:
    """`"package.module:attribute"` → that attribute (the engine class a process builds, named by string so that
    it survives the spawn into a fresh interpreter and the command line of a rank)."""
    module_name, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module_name), attr)
