"""What the tests need from outside the repository, and the one rule for a missing piece: a developer's machine skips
the test, CI fails it (a green run must mean it ran). Recorded agent traffic lives beside the repository, not in it:
the agents' own system prompts are their vendors' text."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import pytest

AGENT_TRAFFIC = Path(__file__).resolve().parents[3].parent / "shared" / "fixtures" / "agent-traffic"


def missing(what: str) -> NoReturn:
    if os.environ.get("CI"):
        pytest.fail(f"{what} (CI must have it: .ci/run installs everything)")
    pytest.skip(what)


def agent_traffic(name: str | None = None) -> Path:
    """The recorded agent traffic folder, or one file in it."""
    path = AGENT_TRAFFIC if name is None else AGENT_TRAFFIC / name
    if not path.exists():
        missing(f"recorded agent traffic not found at {path}")
    return path
