"""SVG snapshots of the screens, from the recorded feed on its own clock (so they do not depend on when they run).

Update after an intended change with `pytest tests/tui/test_snapshots.py --snapshot-update`, and look at the
report pytest-textual-snapshot writes before committing the new SVGs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable

from adaptive_spec.tui.app import DashboardApp, make_app
from adaptive_spec.tui.screens import DetailScreen
from tests.support.waiting import until, within

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


async def _settle(pilot: Pilot[None]) -> None:
    app = pilot.app
    assert isinstance(app, DashboardApp)

    def pause() -> Awaitable[None]:
        return pilot.pause(0.05)

    await until(lambda: any(line.who == "replay" for line in app.dashboard.log), "the end of the replay", step=pause)
    table = app.query_one("#sessions", DataTable)
    table.move_cursor(row=0)  # the detail opens on the most recent session, whatever row was first seen
    table.show_cursor = False  # where the cursor sat while events streamed in is timing, not layout
    for _ in range(2):  # two whole frames after the last event
        app.dirty = True
        await until(lambda: not app.dirty, "a frame after the last event", step=pause)
    await within(pilot.wait_for_scheduled_animations(), "the scheduled animations")
    await pilot.pause(0.2)


def test_dashboard_wide(snap_compare: Callable[..., bool]) -> None:
    assert snap_compare(_app(), terminal_size=(120, 36), run_before=_settle)


def test_dashboard_narrow(snap_compare: Callable[..., bool]) -> None:
    assert snap_compare(_app(), terminal_size=(80, 24), run_before=_settle)


async def _settle_screen(pilot: Pilot[None]) -> None:
    await within(pilot.wait_for_scheduled_animations(), "the detail screen's animations")
    await pilot.pause(0.2)


def test_session_detail(snap_compare: Callable[..., bool]) -> None:
    async def open_detail(pilot: Pilot[None]) -> None:
        await _settle(pilot)
        table = pilot.app.query_one(DataTable)
        table.show_cursor = True  # _settle hides it, and a table without a cursor selects nothing on Enter
        table.move_cursor(row=0)
        await pilot.press("enter")
        await until(lambda: isinstance(pilot.app.screen, DetailScreen), "the session's detail screen", step=pilot.pause)
        await _settle_screen(pilot)

    assert snap_compare(_app(), terminal_size=(120, 36), run_before=open_detail)
