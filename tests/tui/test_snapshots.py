"""SVG snapshots of the screens, from the recorded feed on its own clock (so they do not depend on when they run).

Update after an intended change with `pytest tests/tui/test_snapshots.py --snapshot-update`, and look at the
report pytest-textual-snapshot writes before committing the new SVGs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import DataTable

from adaptive_spec.tui.app import DashboardApp, make_app

FEED = Path(__file__).parent / "data" / "feed.jsonl"


@pytest.fixture(autouse=True)
def utc() -> Iterator[None]:
    old = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield
    if old is None:
        os.environ.pop("TZ", None)
    else:
        os.environ["TZ"] = old
    time.tzset()


def _app() -> DashboardApp:
    app = make_app(replay=FEED, speed=0, frame_s=0.05)
    app.animation_level = "none"  # the log scrolls to its end at once
    return app


async def _settle(pilot: Any) -> None:
    app = pilot.app
    while not any(line.who == "replay" for line in app.dashboard.log):
        await pilot.pause(0.05)
    table = app.query_one("#sessions", DataTable)
    table.move_cursor(row=0)  # the detail opens on the most recent session, whatever row was first seen
    table.show_cursor = False  # where the cursor sat while events streamed in is timing, not layout
    for _ in range(2):  # two whole frames after the last event
        app.dirty = True
        while app.dirty:
            await pilot.pause(0.05)
    await pilot.wait_for_scheduled_animations()
    await pilot.pause(0.2)


def test_dashboard_wide(snap_compare: Callable[..., bool]) -> None:
    assert snap_compare(_app(), terminal_size=(120, 36), run_before=_settle)


def test_dashboard_narrow(snap_compare: Callable[..., bool]) -> None:
    assert snap_compare(_app(), terminal_size=(80, 24), run_before=_settle)


def test_session_detail(snap_compare: Callable[..., bool]) -> None:
    async def open_detail(pilot: Any) -> None:
        await _settle(pilot)
        await pilot.press("enter")
        await pilot.pause(0.3)

    assert snap_compare(_app(), terminal_size=(120, 36), run_before=open_detail)
