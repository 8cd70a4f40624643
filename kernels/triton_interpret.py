"""Run the Triton kernels on the CPU with Triton's interpreter (debugging, the CPU tests, benchmark smoke runs).

`enable()` must run before `triton` is first imported: the interpreter is chosen when the kernels are decorated.
It also works around Triton 3.6's interpreter turning a scalar into an int with int(1-element array), which numpy
>= 2.3 refuses (e.g. `for i in range(0, n)` with a loaded n): it reads the element instead.
"""

from __future__ import annotations

import os
import sys


def enable() -> None:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before the interpreter was enabled")
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_hisparse_patched", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._hisparse_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched
