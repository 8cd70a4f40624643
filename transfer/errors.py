"""Exceptions of the transfer package."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A transfer-engine call failed; the message says which call, to which peer, and why."""


class HandshakeError(RuntimeError):
    """A peer was refused at handshake time (layout or protocol mismatch); the message names the field."""
