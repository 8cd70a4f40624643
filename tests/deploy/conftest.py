"""Fixtures of the deployment tests: every overlay rendered once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from deploy_checks import K8S, OVERLAYS, Obj, render  # noqa: E402


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[Obj]]:
    return {overlay: render(K8S / "overlays" / overlay) for overlay in OVERLAYS}
