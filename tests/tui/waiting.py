"""Waiting in async TUI tests for a condition the app reaches on its own time (never a fixed sleep)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(predicate: Callable[[], object], what: str, limit_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + limit_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def turns(app: object, session_id: str) -> int:
    """How many turns the app shows for a session (0 before it appears)."""
    view = app.dashboard.sessions.get(session_id)  # type: ignore[attr-defined]
    return len(view.turns) if view is not None else 0
