"""Server-sent events framing for OpenAI streaming: `data: {json}\\n\\n` frames ending with `data: [DONE]`."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

DONE_FRAME = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_frame(payload: BaseModel | dict[str, Any]) -> str:
    """One event, compact JSON on one line (a newline inside would end the frame early)."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json()
    else:
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {body}\n\n"


def parse_sse(text: str) -> list[str]:
    """The payloads of a complete event stream (used by tests and the health check)."""
    out = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data:"):
                out.append(line[len("data:") :].strip())
    return out
