"""Which shared libraries that the installed wheels link are missing from this system (`ops check-libs`).

A wheel's compiled modules link system libraries that pip cannot install (mooncake's transfer engine links
libibverbs, libnuma and libcurl even for TCP); a missing one shows only when the module is first imported, e.g.
when a prefill server starts. `ldd` over every ELF shared object under site-packages finds them all at once,
at image build time or on a new host, resolving each library's RPATH/RUNPATH as the loader would.

Standard library only (it runs where torch may not import yet).
"""

from __future__ import annotations

import re
import subprocess
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# Debian/Ubuntu package of each system library a wheel here is known to link (for the hint in the report).
DEBIAN_PACKAGES = {
    "libibverbs.so.1": "libibverbs1",
    "libnuma.so.1": "libnuma1",
    "libcurl.so.4": "libcurl4",
    "libmlx5.so.1": "ibverbs-providers",
    "librdmacm.so.1": "librdmacm1",
}
# Libraries that the NVIDIA container runtime mounts from the host driver when the container starts: absent at
# image build time by design.
DRIVER_LIBRARIES = ("libcuda.so.1", "libnvidia-ml.so.1")

_NOT_FOUND = re.compile(r"^\s*(\S+)\s+=>\s+not found\s*$")
_SHARED_OBJECT = re.compile(r"\.so(\.\d+)*$")


@dataclass
class Report:
    """Missing library soname -> the shared objects that link it."""

    checked: int = 0
    missing: dict[str, list[Path]] = field(default_factory=dict)

    def lines(self) -> list[str]:
        out = []
        for soname, users in sorted(self.missing.items()):
            package = DEBIAN_PACKAGES.get(soname)
            hint = f" (Debian/Ubuntu package {package})" if package else ""
            shown = ", ".join(str(p) for p in users[:3]) + (f" and {len(users) - 3} more" if len(users) > 3 else "")
            out.append(f"{soname}{hint} is missing; linked by {shown}")
        return out


def default_roots() -> list[Path]:
    """This interpreter's site-packages. (Not torch extensions such as the prebuilt kernels: they link libtorch
    without a search path of their own, relying on torch being loaded first, so ldd cannot resolve them.)"""
    paths = sysconfig.get_paths()
    return sorted({Path(p) for p in (paths["purelib"], paths["platlib"]) if Path(p).is_dir()})


def shared_objects(roots: Iterable[Path]) -> Iterator[Path]:
    """ELF files named like shared objects (`x.so`, `x.so.1.2`) under the roots; symlinks are skipped (their
    targets are found by name anyway)."""
    for root in roots:
        for path in sorted(root.rglob("*.so*")):
            if path.is_symlink() or not path.is_file() or not _SHARED_OBJECT.search(path.name):
                continue
            with path.open("rb") as fh:
                if fh.read(4) == b"\x7fELF":
                    yield path


def unresolved(library: Path) -> list[str]:
    """Sonames `ldd` cannot resolve for one shared object ([] for one it cannot inspect, e.g. another arch)."""
    result = subprocess.run(["ldd", str(library)], capture_output=True, text=True, timeout=60)
    found = [m.group(1) for line in result.stdout.splitlines() if (m := _NOT_FOUND.match(line))]
    return list(dict.fromkeys(found))  # ldd repeats a soname that several of the object's dependencies lack


def shipped_names(roots: Iterable[Path]) -> set[str]:
    """File names of the shared objects the roots' wheels ship (symlinks included: a soname is often one). A
    library one wheel links without a search path and another wheel ships is loaded by that wheel's Python package
    before its user's (xgrammar's bindings link libtvm_ffi.so, which `import tvm_ffi` loads first, as torch
    extensions rely on torch's libraries): it is there, though ldd alone cannot find it."""
    return {path.name for root in roots for path in root.rglob("*.so*") if _SHARED_OBJECT.search(path.name)}


def check(roots: Iterable[Path], allowed: Iterable[str] = ()) -> Report:
    roots = list(roots)
    allowed = set(allowed) | shipped_names(roots)
    report = Report()
    for library in shared_objects(roots):
        report.checked += 1
        for soname in unresolved(library):
            if soname not in allowed:
                report.missing.setdefault(soname, []).append(library)
    return report
