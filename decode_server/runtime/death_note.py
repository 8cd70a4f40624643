"""Why the engine process died, written to a file beside its sockets: the channel that survives a hard exit.

The engine tells the api why it is dying with a `FatalMsg` over ZMQ, but a message still queued when the process
ends is lost: rank 0's supervisor ends the process with `os._exit` once a rank has died, and on a loaded machine the
message had not always left by then (three CI runs from 2026-11-27 to 2026-11-29 reported a killed tensor-parallel
rank 1 as "exit code 1"). A file written before the exit cannot be lost that way. The api reads it when the process
is gone and no `FatalMsg` came.

The file lives in the api's private temporary directory, the one that holds the `ipc://` sockets, so both sides
find it from the engine's address alone and the api's clean-up removes it with the sockets. Needs no torch.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

NOTE_NAME = "engine_death_reason"


def note_path(from_engine_addr: str) -> Path | None:
    """The note's path for the api's engine socket address; None where the address is not a local ipc path."""
    prefix = "ipc://"
    if not from_engine_addr.startswith(prefix):
        return None
    return Path(from_engine_addr[len(prefix):]).parent / NOTE_NAME


def write_note(from_engine_addr: str, reason: str, replace: bool) -> None:
    """Record `reason`. `replace` False keeps a note already written: a rank's death (written with `replace` True
    by whichever thread of rank 0 sees it) says more than the collective's error that it caused elsewhere. Never
    raises: the process is dying, and the note is only the better error message."""
    path = note_path(from_engine_addr)
    if path is None:
        return
    with contextlib.suppress(OSError):
        if not replace and path.exists():
            return
        tmp = path.with_name(f"{NOTE_NAME}.{os.getpid()}.{os.urandom(4).hex()}")
        tmp.write_text(reason)
        os.replace(tmp, path)  # atomic: the api reads a whole note or none


def read_note(from_engine_addr: str) -> str:
    """The recorded reason, or "" where none was written (or the address has no note)."""
    path = note_path(from_engine_addr)
    if path is None:
        return ""
    try:
        return path.read_text().strip()
    except OSError:
        return ""
