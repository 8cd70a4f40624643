"""The PD fields of one engine request (from the OpenAI body extras `bootstrap_host`, `bootstrap_port`,
`bootstrap_room`, as SGLang's router sends them). Free of torch: the api process builds these."""

from __future__ import annotations

from dataclasses import dataclass

MAX_ROOM = 2**128 - 1  # our router draws 128 random bits (SGLang's routers send 63-bit rooms: also accepted)


@dataclass(frozen=True)
class BootstrapInfo:
    host: str  # the prefill server's bootstrap host (decode connects there; prefill ignores it)
    port: int  # the prefill server's bootstrap port
    room: int  # the router's id of this request's transfer, the same on both servers
