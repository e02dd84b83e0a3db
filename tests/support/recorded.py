"""llama-server's own answers, recorded once from a real server (tests/data/llama-server/README.md says how and from
which build): the tests that need them read these, never dicts made up to look like them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RECORDED = Path(__file__).resolve().parents[1] / "data" / "llama-server"


def recorded(name: str) -> Any:
    """The recorded answer `name` (tests/data/llama-server/NAME.json), parsed afresh: callers may change it."""
    return json.loads((RECORDED / f"{name}.json").read_text())
