"""The error `import mooncake.engine` gives when a system library is missing names the package to install (issue
27: libcurl.so.4 was missing from the CPU image and the hint only knew libibverbs)."""

from __future__ import annotations

from transfer.mooncake_transport import install_hint


def test_each_linked_system_library_names_its_package() -> None:
    for message, package in [
        ("libcurl.so.4: cannot open shared object file: No such file or directory", "libcurl4"),
        ("libibverbs.so.1: cannot open shared object file: No such file or directory", "libibverbs1"),
        ("libnuma.so.1: cannot open shared object file: No such file or directory", "libnuma1"),
        ("libmlx5.so.1: cannot open shared object file: No such file or directory", "ibverbs-providers"),
    ]:
        assert f"apt-get install {package} " in install_hint(message)


def test_other_failures_keep_their_hints() -> None:
    assert "another CUDA version" in install_hint("libcudart.so.12: cannot open shared object file")
    assert "install the PD extra" in install_hint("No module named 'mooncake'")
