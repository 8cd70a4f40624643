"""Exceptions of the transfer package."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A transfer-engine call failed; the message says which call, to which peer, and why."""

