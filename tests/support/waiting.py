"""Waiting in async tests for a condition the app reaches on its own time: never a fixed sleep, never without a
deadline (a wait that fails says what it waited for), and the conditions the TUI tests wait on most."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from adaptive_spec.tui.app import DashboardApp

T = TypeVar("T")


async def until(
    predicate: Callable[[], object],
    what: str,
    limit_s: float = 30.0,
    *,
    step: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Returns once `predicate()` holds, checking every 20 ms (or after each `step()`, such as a Pilot's pause, which
    also lets the app process its messages); fails after `limit_s` seconds, naming `what` it waited for."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {limit_s} s waiting for {what}")
        await (step() if step is not None else asyncio.sleep(0.02))


async def within(awaitable: Awaitable[T], what: str, limit_s: float = 30.0) -> T:
    """Awaits something that ends on its own time (a Pilot's wait for animations); fails after `limit_s` seconds,
    naming `what` it waited for."""
    try:
        async with asyncio.timeout(limit_s):
            return await awaitable
    except TimeoutError:
        raise AssertionError(f"timed out after {limit_s} s waiting for {what}") from None


def turns(app: DashboardApp, session_id: str) -> int:
    """How many turns the TUI app shows for a session (0 before it appears)."""
    view = app.dashboard.sessions.get(session_id)
    return len(view.turns) if view is not None else 0
