"""`python -m decode_server.ops check-libs` (decode_server/shared_libs.py), the images' build-time check that every
library a wheel links resolves: on real ELF files compiled here, one linking a library that is then removed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from decode_server import shared_libs

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or shutil.which("ldd") is None, reason="needs cc, ldd")


def _compile(out: Path, source: str, *flags: str) -> None:
    src = out.with_suffix(".c")
    src.write_text(source)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(out), str(src), *flags], check=True, timeout=120)
    src.unlink()


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """site/pkg/_ext.so links libhs_gone.so.1 (removed after linking) and libkept.so (kept, found through
    $ORIGIN); site/pkg/ok.so.1 links only libc; a non-ELF *.so and a symlink ride along."""
    lib = tmp_path / "lib"
    pkg = tmp_path / "site" / "pkg"
    lib.mkdir()
    pkg.mkdir(parents=True)
    _compile(lib / "libhs_gone.so.1", "int gone(void) { return 1; }", "-Wl,-soname,libhs_gone.so.1")
    _compile(pkg / "libkept.so", "int kept(void) { return 2; }")
    _compile(pkg / "_ext.so", "int gone(void); int kept(void); int f(void) { return gone() + kept(); }",
             f"-L{lib}", "-l:libhs_gone.so.1", f"-L{pkg}", "-lkept", "-Wl,-rpath,$ORIGIN")  # fmt: skip
    _compile(pkg / "ok.so.1", "int g(void) { return 3; }")
    (pkg / "notes.so").write_text("not an ELF file")
    (pkg / "ok.so").symlink_to("ok.so.1")
    shutil.rmtree(lib)
    return tmp_path / "site"


def test_reports_the_missing_library_and_its_users(tree: Path) -> None:
    report = shared_libs.check([tree])
    assert report.checked == 3  # _ext.so, libkept.so, ok.so.1 (not the text file, not the symlink)
    assert report.missing == {"libhs_gone.so.1": [tree / "pkg" / "_ext.so"]}
    assert report.lines() == [f"libhs_gone.so.1 is missing; linked by {tree / 'pkg' / '_ext.so'}"]
    assert shared_libs.check([tree], allowed=["libhs_gone.so.1"]).missing == {}


def test_a_library_another_wheel_ships_counts_as_present(tree: Path) -> None:
    """Like libtvm_ffi.so for xgrammar: linked without a search path, shipped (and loaded first) by another package
    in the same site-packages."""
    other = tree / "other_pkg" / "lib"
    other.mkdir(parents=True)
    _compile(other / "libhs_gone.so.1", "int gone(void) { return 1; }", "-Wl,-soname,libhs_gone.so.1")
    report = shared_libs.check([tree])
    assert report.missing == {} and report.checked == 4
    assert "libhs_gone.so.1" in shared_libs.shipped_names([tree])


def test_report_names_the_debian_package() -> None:
    users = [Path(f"/site/m/{i}.so") for i in range(5)]
    report = shared_libs.Report(checked=5, missing={"libcurl.so.4": users})
    assert report.lines() == ["libcurl.so.4 (Debian/Ubuntu package libcurl4) is missing; linked by /site/m/0.so, "
                              "/site/m/1.so, /site/m/2.so and 2 more"]


def test_ops_check_libs_exit_status(tree: Path) -> None:
    def ops(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "decode_server.ops", "check-libs", *args],
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    missing = ops(str(tree))
    assert missing.returncode == 1 and "libhs_gone.so.1 is missing; linked by" in missing.stderr
    allowed = ops(str(tree), "--allow", "libhs_gone.so.1")
    assert allowed.returncode == 0 and "every library linked by 3 shared objects" in allowed.stderr
    (tree / "pkg" / "_ext.so").unlink()
    assert ops(str(tree)).returncode == 0
    absent = ops(str(tree), str(tree / "no-such-package"))
    assert absent.returncode == 1 and "no such directory" in absent.stderr


def test_this_environment_resolves_every_library() -> None:
    """The test environment itself (what `make install` set up, system libraries included)."""
    report = shared_libs.check(shared_libs.default_roots())
    assert report.checked > 0 and report.missing == {}, report.lines()
