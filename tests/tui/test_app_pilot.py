"""The app driven by a recorded feed (tests/tui/data/feed.jsonl, recorded from a real proxy with `tui --record`):
what it shows must add up to the records in the recording."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest
from textual.message import Message
from textual.widgets import DataTable, Static

from adaptive_spec.tui.app import DashboardApp, make_app
from adaptive_spec.tui.screens import DetailScreen, HelpScreen, PickScreen
from tests.support.processes.servers import free_port
from tests.support.waiting import until

FEED = Path(__file__).parent / "data" / "feed.jsonl"

pytestmark = pytest.mark.asyncio(loop_scope="function")


def _records() -> list[dict[str, Any]]:
    lines = [orjson.loads(line) for line in FEED.read_bytes().splitlines() if line.strip()]
    return [e["record"] for e in lines if e["type"] in ("RequestFinished", "RequestFailed")]


async def _replayed(app: DashboardApp) -> None:
    await until(lambda: any(line.who == "replay" for line in app.dashboard.log), "the end of the replay")
    await until(lambda: app.frames > 0 and not app.dirty, "a frame after the replay")


async def test_replay_adds_up_to_the_recorded_records() -> None:
    messages: list[Message] = []
    app = make_app(replay=FEED, speed=0, frame_s=0.05)
    async with app.run_test(size=(120, 36), message_hook=messages.append) as pilot:
        await _replayed(app)
        await pilot.pause()
        records = _records()
        board = app.dashboard
        assert board.requests_total == len(records)
        for sid, view in board.sessions.items():
            mine = [r for r in records if r["session_id"] == sid]
            assert len(view.turns) == len(mine)
            assert view.draft_n == sum((r["timings"] or {}).get("draft_n", 0) for r in mine)
            assert view.draft_n_accepted == sum((r["timings"] or {}).get("draft_n_accepted", 0) for r in mine)
        for name, profile in board.profiles.items():
            mine = [r for r in records if r["profile"] == name]
            assert profile.predicted_n == sum((r["timings"] or {}).get("predicted_n", 0) for r in mine)
        table = app.query_one("#sessions", DataTable)
        assert table.row_count == len(board.sessions)
        profiles_text = str(app.query_one("#profiles", Static).render())
        assert all(name in profiles_text for name in board.profiles)
        assert any(type(m).__name__ == "Resize" for m in messages)


async def test_enter_opens_the_session_detail_and_escape_returns() -> None:
    app = make_app(replay=FEED, speed=0, frame_s=0.05)
    async with app.run_test(size=(120, 36)) as pilot:
        await _replayed(app)
        app.query_one("#sessions", DataTable).focus()
        await pilot.press("enter")
        await until(lambda: isinstance(app.screen, DetailScreen), "the detail screen")
        screen = app.screen
        assert isinstance(screen, DetailScreen)
        turns = screen.query_one("#turns", DataTable)
        assert turns.row_count == len(app.dashboard.sessions[screen.session_id].turns) > 0
        await pilot.press("escape")
        await until(lambda: not isinstance(app.screen, DetailScreen), "the dashboard again")


async def test_filter_sort_pause_and_help() -> None:
    app = make_app(replay=FEED, speed=0, frame_s=0.05)
    async with app.run_test(size=(120, 36)) as pilot:
        await _replayed(app)
        table = app.query_one("#sessions", DataTable)
        some = next(iter(app.dashboard.sessions))
        await pilot.press("slash", *some)
        await until(lambda: table.row_count == 1, "the filtered table")
        await pilot.press("escape")
        await until(lambda: table.row_count == len(app.dashboard.sessions), "the unfiltered table")
        await pilot.press("s")
        assert app.sort == 1
        await pilot.press("space")
        frames = app.frames
        app.dirty = True
        await asyncio.sleep(0.3)
        assert app.frames == frames and app.paused
        await pilot.press("space")
        await until(lambda: app.frames > frames, "a frame after resuming")
        await pilot.press("question_mark")
        await until(lambda: isinstance(app.screen, HelpScreen), "the help")


async def test_controls_are_refused_in_a_replay() -> None:
    app = make_app(replay=FEED, speed=0, frame_s=0.05)
    async with app.run_test(size=(120, 36)) as pilot:
        await _replayed(app)
        await pilot.press("p")
        await until(lambda: any("replay" in n.message for n in app._notifications), "the refusal")
        assert not isinstance(app.screen, PickScreen)


async def test_no_proxy_says_how_to_start_one_and_keeps_trying() -> None:
    port = free_port()
    app = make_app(url=f"http://127.0.0.1:{port}", frame_s=0.05)
    async with app.run_test(size=(80, 24)):
        await until(lambda: "answers at" in app.last_error, "the connection error")
        await until(lambda: app.query_one("#banner").has_class("-active"), "the banner")
        banner = str(app.query_one("#banner", Static).render())
        assert "No adaptive-spec proxy answers" in banner and "adaptive-spec serve" in banner
        assert not app.connected
