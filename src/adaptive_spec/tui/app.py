"""The Textual app: the dashboard screen's layout, the feed worker that folds each item into the picture, the
frame timer that redraws it, and what the keys do.

Events are folded into `Dashboard` as they arrive (cheap); the screen is redrawn from it by a timer at a bounded
rate, so a burst of events never queues up redraws: newer state simply replaces what the last frame showed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import IO, Any, ClassVar

import orjson
from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import BindingType
from textual.css.query import NoMatches
from textual.events import Resize
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Input, Static

from adaptive_spec.telemetry.decoding import decode_event
from adaptive_spec.telemetry.events import EventsDropped
from adaptive_spec.tui import bindings, panels, render
from adaptive_spec.tui.child import ServeChild
from adaptive_spec.tui.feed import ControlError, FeedItem, ProxyClient
from adaptive_spec.tui.model import Dashboard
from adaptive_spec.tui.screens import ConfirmScreen, DetailScreen, HelpScreen, PickScreen
from adaptive_spec.tui.sessions import SORTS, shown

NARROW_COLUMNS = 110


class DashboardApp(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "adaptive-spec"
    ENABLE_COMMAND_PALETTE = False  # every action has its own key, shown in the footer
    BINDINGS: ClassVar[list[BindingType]] = bindings.DASHBOARD

    def __init__(
        self,
        source: Callable[[], AsyncIterator[FeedItem]],
        *,
        label: str,
        client: ProxyClient | None = None,
        clock: Callable[[], float] | None = None,
        frame_s: float = 0.25,
        record: IO[bytes] | None = None,
    ) -> None:
        super().__init__()
        self.dashboard = Dashboard()
        self._source = source
        self.label = label
        self.client = client
        self._wall_clock = clock or time.time
        self.replaying = False
        self.replay_now = 0.0  # a replay runs on the recording's clock: the time of the last event replayed
        self.frame_s = frame_s
        self.record = record
        self.connected = False
        self.ever_connected = False
        self.connected_since: float | None = None
        self.last_error = ""
        self.paused = False
        self.dirty = True
        self.frames = 0
        self.frame_ms: deque[float] = deque(maxlen=1000)  # how long recent redraws took (the benchmark reads it)
        self.events_seen = 0
        self.sort = 0
        self.filter_text = ""
        self._narrow = False
        self.child_argv: list[str] | None = None  # `serve --tui`: the proxy this app starts and stops
        self.child: ServeChild | None = None
        self.child_exit_code: int | None = None

    @property
    def _main(self) -> Screen[Any]:
        """The dashboard: the first screen; the detail and the dialogs are pushed over it."""
        return self.screen_stack[0]

    # ---- layout ----------------------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Static(id="status")
        yield panels.Banner(id="banner")
        profiles = Static(id="profiles")
        profiles.border_title = "profiles"
        yield profiles
        chart = panels.ChartPanel(id="chart")
        chart.border_title = "acceptance │ decode tok/s, one point a second"
        yield chart
        sessions = panels.SessionTable(id="sessions")
        sessions.border_title = "sessions"
        yield sessions
        yield Input(placeholder="filter sessions: session, client, project or profile (esc clears)", id="filter")
        log = panels.LogView(lambda: self.dashboard.log, id="log")
        log.border_title = "log"
        yield log
        yield Footer()

    def on_mount(self) -> None:
        self._narrow = self.size.width < NARROW_COLUMNS
        self._main.set_class(self._narrow, "-narrow")
        self.set_interval(self.frame_s, self._frame)
        if self.child_argv:
            self._run_child()
        self._follow()

    def on_resize(self, event: Resize) -> None:
        narrow = event.size.width < NARROW_COLUMNS
        if narrow != self._narrow:
            self._narrow = narrow
            self._main.set_class(narrow, "-narrow")
        self.dirty = True  # the sessions table fits its columns to the new width

    # ---- the feed --------------------------------------------------------------------------------------------
    @work(exclusive=True, group="feed")
    async def _follow(self) -> None:
        async for item in self._source():
            self.handle(item)

    def clock(self) -> float:
        return self.replay_now if self.replaying else self._wall_clock()

    def handle(self, item: FeedItem) -> None:
        """Fold one feed item into the state (called for every event: keep it cheap)."""
        if self.replaying:
            at = item.payload.get("at_unix")
            if isinstance(at, int | float) and at > self.replay_now:
                self.replay_now = float(at)
        now = self.clock()
        self.events_seen += 1
        self.dirty = True
        if self.replaying:
            self.dashboard.tick(now)  # the recording's seconds, however fast they are replayed
        if self.record is not None and item.kind not in (
            "connected",
            "disconnected",
            "history",
            "route",
            "replay-ended",
        ):
            self.record.write(orjson.dumps({"type": item.kind, **item.payload}) + b"\n")
        if item.kind == "connected":
            self.replaying = bool(item.payload.get("replay"))
            self._connected(now, replay=self.replaying)
        elif item.kind == "disconnected":
            self._disconnected(now, str(item.payload.get("error") or "connection lost"))
        elif item.kind == "history":
            self.dashboard.load_requests(item.payload.get("requests") or [])
        elif item.kind == "route":
            self.dashboard.load_route(item.payload)
        elif item.kind == "replay-ended":
            self.dashboard.note(now, "note", "replay", "end of the recording")
        elif item.kind == "snapshot":
            self.dashboard.load_snapshot(item.payload, now)
        else:
            event = decode_event(item.kind, item.payload)  # None: a kind this version does not know (a newer proxy's)
            if event is not None:
                self.dashboard.apply(event, now)
            if isinstance(event, EventsDropped):
                self._resync()

    def _connected(self, now: float, *, replay: bool) -> None:
        keep = self.dashboard
        self.dashboard = Dashboard()  # a fresh snapshot and history follow: rebuild from them
        for name, old in keep.profiles.items():  # but keep what the charts and log already showed
            self.dashboard.profile(name).chart.extend(old.chart)
        self.dashboard.log.extend(keep.log)
        self.dashboard.note(now, "note", "feed", f"connected to {self.label}")
        self.connected, self.ever_connected = True, True
        self.connected_since = None if replay else now

    def _disconnected(self, now: float, error: str) -> None:
        if self.connected or not self.last_error:
            self.dashboard.note(now, "fail", "feed", f"disconnected: {error}; retrying")
        self.connected, self.connected_since, self.last_error = False, None, error

    @work(exclusive=True, group="resync")
    async def _resync(self) -> None:
        if self.client is None:
            return
        try:
            history = await self.client.get_json("/adaptive/requests")
        except (ControlError, OSError) as exc:
            self.dashboard.note(self.clock(), "fail", "feed", f"resync failed: {exc}")
            return
        added = self.dashboard.load_requests(history.get("requests") or [])
        self.dashboard.note(self.clock(), "note", "feed", f"resynced from history: {added} requests recovered")
        self.dirty = True

    # ---- serve --tui: the proxy as a child whose output goes to the log ------------------------------------------
    @work(exclusive=True, group="child")
    async def _run_child(self) -> None:
        assert self.child_argv is not None
        self.child = ServeChild(self.child_argv)
        async for line in self.child.lines():
            self.dashboard.note(self.clock(), "serve", "serve", line)
            self.last_error = line
            self.dirty = True
        self.child_exit_code = await self.child.wait()
        self.dashboard.note(self.clock(), "fail", "serve", f"serve exited with code {self.child_exit_code}")
        self.last_error = f"serve exited with code {self.child_exit_code}: {self.last_error}"
        self.dirty = True

    async def stop_child(self) -> None:
        if self.child is None or not self.child.running:
            return
        self.notify("stopping adaptive-spec serve and its llama-servers…")
        self.child_exit_code = await self.child.stop()

    async def on_unmount(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def action_quit(self) -> None:
        await self.stop_child()
        self.exit()

    # ---- drawing ---------------------------------------------------------------------------------------------
    def _frame(self) -> None:
        now = self.clock()
        if self.dashboard.tick(now):
            self.dirty = True
        if self.paused or not self.dirty:
            return
        self.dirty = False
        self.frames += 1
        started = time.perf_counter()
        try:
            self.redraw(now)
        except NoMatches:  # a frame while the screen is still being composed or already torn down: skip it
            self.dirty = True
        self.frame_ms.append((time.perf_counter() - started) * 1000)

    def redraw(self, now: float) -> None:
        board = self.dashboard
        self._main.query_one("#status", Static).update(
            render.status_line(
                board,
                url=self.label,
                connected=self.connected,
                since=self.connected_since,
                paused=self.paused,
                now=now,
            )
        )
        self._main.query_one("#banner", panels.Banner).show(
            waiting=not self.connected and not self.ever_connected,
            url=self.label,
            error=self.last_error,
            starting=bool(self.child_argv) and self.child_exit_code is None,
        )
        lines = Text("\n").join(render.profile_lines(v, now, narrow=self._narrow) for v in board.profiles.values())
        self._main.query_one("#profiles", Static).update(lines if board.profiles else Text("waiting for the proxy…"))
        if not self._main.query_one("#chart", panels.ChartPanel).draw(board.profiles, now, narrow=self._narrow):
            self.dirty = True
        self._draw_sessions()
        self._main.query_one("#log", panels.LogView).refresh()
        if isinstance(self.screen, DetailScreen):
            self.screen.refresh_view()

    def _draw_sessions(self) -> None:
        views = shown(self.dashboard.sessions.values(), self.filter_text, SORTS[self.sort])
        live = sum(1 for v in views if v.in_flight)
        filt = f" · filter '{self.filter_text}'" if self.filter_text else ""
        self._main.query_one("#sessions", panels.SessionTable).draw(
            views,
            narrow=self._narrow,
            keep=self.screen.session_id if isinstance(self.screen, DetailScreen) else None,
            title=f"sessions ({len(views)}, {live} active) · sort: {SORTS[self.sort]}{filt}",
        )

    # ---- keys ------------------------------------------------------------------------------------------------
    def selected_session(self) -> str | None:
        if isinstance(self.screen, DetailScreen):
            return self.screen.session_id
        return self._main.query_one("#sessions", panels.SessionTable).selected()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.data_table.id == "sessions" and event.row_key.value is not None:
            self.push_screen(DetailScreen(str(event.row_key.value), lambda: self.dashboard))

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.dirty = True
        self.redraw(self.clock())  # show the PAUSED mark at once, then nothing until resumed

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_sort(self) -> None:
        self.sort = (self.sort + 1) % len(SORTS)
        self.dirty = True

    def action_filter(self) -> None:
        box = self._main.query_one("#filter", Input)
        box.add_class("-active")
        box.focus()

    def action_clear_filter(self) -> None:
        box = self._main.query_one("#filter", Input)
        box.value = ""
        self.filter_text = ""
        box.remove_class("-active")
        self._main.query_one("#sessions", DataTable).focus()
        self.dirty = True

    def on_input_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value.strip()
        self.dirty = True

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self._main.query_one("#sessions", DataTable).focus()

    def _control_ready(self) -> bool:
        if self.client is None:
            self.notify("controls need a live proxy (this is a replay)", severity="warning")
            return False
        return True

    def action_pin(self) -> None:
        session = self.selected_session()
        if session is None or not self._control_ready():
            return
        choices = [(name, f"{name}  ({render.spec_label(v)})") for name, v in self.dashboard.profiles.items()]
        choices.append(("\0auto", "automatic: let the router choose again"))

        def picked(choice: str | None) -> None:
            if choice is not None:
                self._pin(session, None if choice == "\0auto" else choice)

        self.push_screen(PickScreen(f"Pin session {session} to:", choices), picked)

    def action_auto(self) -> None:
        session = self.selected_session()
        if session is not None and self._control_ready():
            self._pin(session, None)

    @work(group="control")
    async def _pin(self, session: str, profile: str | None) -> None:
        assert self.client is not None
        try:
            await self.client.pin(session, profile)
        except ControlError as exc:
            self.notify(f"pin failed: {exc}", severity="error")
            return
        self.notify(f"{session}: " + (f"pinned to {profile}" if profile else "back to automatic routing"))
        self.dirty = True

    def action_restart(self) -> None:
        if not self._control_ready():
            return
        choices = [(name, f"{name}  ({'up' if v.up else 'down'})") for name, v in self.dashboard.profiles.items()]

        def picked(name: str | None) -> None:
            if name is None:
                return
            question = (
                f"Restart profile [b]{name}[/b]?\nIts llama-server restarts: requests in flight on it fail, and its KV "
                "and n-gram caches start empty."
            )

            def confirmed(yes: bool | None) -> None:
                if yes:
                    self._restart(name)

            self.push_screen(ConfirmScreen(question), confirmed)

        self.push_screen(PickScreen("Restart which profile?", choices), picked)

    @work(group="control")
    async def _restart(self, name: str) -> None:
        assert self.client is not None
        self.notify(f"restarting {name}…")
        try:
            result = await self.client.restart(name)
        except ControlError as exc:
            self.notify(f"restart failed: {exc}", severity="error")
            return
        self.notify(f"{name} restarted in {result.get('seconds', '?')} s")


def make_app(
    *,
    url: str | None = None,
    api_key: str | None = None,
    replay: Path | None = None,
    speed: float = 1.0,
    record: IO[bytes] | None = None,
    frame_s: float = 0.25,
) -> DashboardApp:
    """The app for a live proxy at `url`, or for a recorded feed or trace file (`replay`)."""
    if replay is not None:
        from adaptive_spec.tui.feed import replay as replay_source

        path = replay
        return DashboardApp(lambda: replay_source(path, speed), label=f"replay of {path.name}", frame_s=frame_s)
    client = ProxyClient(url or "http://127.0.0.1:8088", api_key)
    return DashboardApp(client.events, label=client.base_url, client=client, record=record, frame_s=frame_s)
