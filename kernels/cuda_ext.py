"""Build and load the CUDA kernels (kernels/csrc/hisparse_kernels.cu: swap-in, backup, row copies;
kernels/csrc/topk_kernels.cu: the indexer's top-k) as one module with torch's extension builder.

Two ways to get the compiled module:
- JIT, on first CUDA use: built for the current device's architecture (sm_90a on Hopper) and cached under
  $HISPARSE_KERNEL_CACHE (default ~/.cache/hisparse_kernels/<arch>); a later process loads the cached build in
  well under a second (ninja finds it up to date).
- Ahead of time, without a GPU (`python -m decode_server.ops build-kernels --arch 90a ...`, which the CUDA image
  runs at build time): `build_extension` compiles for a named architecture and writes a stamp with the source's
  hash next to the library. `load_extension` imports such a prebuilt library directly, so the runtime needs
  neither nvcc nor ninja; a stamp whose hash no longer matches the source is ignored (JIT rebuild instead), so an
  edited kernel never runs stale.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import threading
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in ("hisparse_kernels.cu", "topk_kernels.cu"))
_STAMP = "prebuilt.json"
_lock = threading.Lock()
_module: ModuleType | None = None


def arch_for_capability(major: int, minor: int) -> str:
    """Architecture name used for builds and cache folders: '90a' on Hopper (its arch-specific features), else
    'XY' (e.g. '80', '100')."""
    return f"{major}{minor}" + ("a" if major == 9 else "")


def _current_arch() -> str:
    return arch_for_capability(*torch.cuda.get_device_capability())


def cache_root() -> Path:
    return Path(os.environ.get("HISPARSE_KERNEL_CACHE", Path.home() / ".cache" / "hisparse_kernels"))


def _module_name(arch: str) -> str:
    return f"hisparse_kernels_sm{arch}"


def source_digest() -> str:
    digest = hashlib.sha256()
    for source in _SOURCES:
        digest.update(source.read_bytes())
    return digest.hexdigest()


def _compile(arch: str, build_dir: Path) -> ModuleType:
    from torch.utils.cpp_extension import load

    gencode = f"-gencode=arch=compute_{arch},code=sm_{arch}"
    build_dir.mkdir(parents=True, exist_ok=True)
    logger.info("loading HiSparse CUDA kernels (%s) from %s", gencode, build_dir)
    return load(
        name=_module_name(arch),
        sources=[str(source) for source in _SOURCES],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-lineinfo", gencode, "-Xptxas=-v"],
        build_directory=str(build_dir),
        verbose=os.environ.get("HISPARSE_KERNEL_VERBOSE") == "1",
    )


def prebuilt_library(build_dir: Path, arch: str) -> Path | None:
    """The library `build_extension` left in `build_dir`, if its stamp matches this source and torch; else None."""
    try:
        stamp = json.loads((build_dir / _STAMP).read_text())
    except (OSError, ValueError):
        return None
    library = build_dir / stamp.get("library", "")
    expected = {"arch": arch, "source_sha256": source_digest(), "torch": torch.__version__}
    if any(stamp.get(k) != v for k, v in expected.items()) or not library.is_file():
        return None
    return library


def _import_library(name: str, library: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(library))
    spec = importlib.util.spec_from_file_location(name, library, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def build_extension(arch: str, root: Path | None = None) -> Path:
    """Compile for `arch` (e.g. '90a', '100') into <root>/sm_<arch> without needing a GPU, and stamp it so that
    `load_extension` on a device of that architecture imports it as is. Returns the library's path."""
    build_dir = (root or cache_root()) / f"sm_{arch}"
    try:
        library = Path(_compile(arch, build_dir).__file__ or "")
    except ImportError:
        # torch's builder imports what it built; on a build machine without a GPU driver (an image build) that
        # import can fail although the library is complete. The runtime imports it on a GPU host.
        library = build_dir / f"{_module_name(arch)}.so"
        if not library.is_file():
            raise
        logger.warning("built %s but could not import it here (no GPU driver?); it loads on a GPU host", library)
    stamp = {"arch": arch, "source_sha256": source_digest(), "torch": torch.__version__,
             "library": library.name}  # fmt: skip
    (build_dir / _STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
    return library


def load_extension() -> ModuleType:
    """The compiled module (`swap_in`, `SwapInContext`, `backup`, `copy_rows`, `topk_rows`,
    `topk_rows_max_width`): the prebuilt one if there is one, else JIT-built."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            arch = _current_arch()
            build_dir = cache_root() / f"sm_{arch}"
            library = prebuilt_library(build_dir, arch)
            if library is not None:
                logger.info("loading prebuilt HiSparse CUDA kernels from %s", library)
                _module = _import_library(_module_name(arch), library)
            else:
                _module = _compile(arch, build_dir)
    return _module
