"""JIT build of kernels/csrc/hisparse_kernels.cu with torch's extension builder, on first CUDA use only.

Built for the current device's architecture (sm_90a on Hopper) and cached under $HISPARSE_KERNEL_CACHE
(default ~/.cache/hisparse_kernels/<arch>): a later process loads the cached build in well under a second.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "hisparse_kernels.cu"
_lock = threading.Lock()
_module: ModuleType | None = None


def _arch_flag() -> tuple[str, str]:
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}" + ("a" if major == 9 else "")
    return arch, f"-gencode=arch=compute_{arch},code=sm_{arch}"


def load_extension() -> ModuleType:
    """The compiled module (functions `swap_in`, `backup`); builds it the first time."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            from torch.utils.cpp_extension import load

            arch, gencode = _arch_flag()
            root = Path(os.environ.get("HISPARSE_KERNEL_CACHE", Path.home() / ".cache" / "hisparse_kernels"))
            build_dir = root / f"sm_{arch}"
            build_dir.mkdir(parents=True, exist_ok=True)
            logger.info("loading HiSparse CUDA kernels (%s) from %s", gencode, build_dir)
            _module = load(
                name=f"hisparse_kernels_sm{arch}",
                sources=[str(_SOURCE)],
                extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3", "-lineinfo", gencode, "-Xptxas=-v"],
                build_directory=str(build_dir),
                verbose=os.environ.get("HISPARSE_KERNEL_VERBOSE") == "1",
            )
    return _module
