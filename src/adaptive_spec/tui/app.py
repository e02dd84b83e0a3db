"""The Textual app: the dashboard screen, the feed worker that folds events into the state, and the keys.

Events are folded into `Dashboard` as they arrive (cheap); the screen is redrawn from it by a timer at a bounded
rate, so a burst of events never queues up redraws: newer state simply replaces what the last frame showed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import IO, Any, ClassVar

import orjson
from rich.markup import escape
from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.events import Resize
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import DataTable, Footer, Input, Label, Sparkline, Static
from textual.widgets.data_table import CellDoesNotExist, RowDoesNotExist

from adaptive_spec.tui import render
from adaptive_spec.tui.feed import ControlError, FeedItem, ProxyClient
from adaptive_spec.tui.model import Dashboard, LogLine
from adaptive_spec.tui.screens import ConfirmScreen, DetailScreen, HelpScreen, PickScreen

NARROW_COLUMNS = 110
CHART_MIN_POINTS = 120  # the chart spans at least two minutes
SORTS = ("last active", "turns", "accepted", "tok/s", "profile")

NO_PROXY = """\
[b]No adaptive-spec proxy answers at {url}[/b]

{error}

Start one in another terminal:   [b]adaptive-spec serve[/b]
or serve and watch in this one:  [b]adaptive-spec serve --tui[/b]
Pointing at another address?     [b]adaptive-spec tui --url http://HOST:PORT[/b] (and --api-key if it needs one)

Retrying every few seconds…"""

REFUSED = """\
[b]The adaptive-spec proxy at {url} refused this view[/b]

{error}

It needs its API key: [b]adaptive-spec tui --api-key KEY[/b] (or set $ADAPTIVE_SPEC_API_KEY), and a host name it
allows (serve --allow-host). Retrying every few seconds…"""

STARTING = """\
[b]Starting adaptive-spec serve at {url}[/b] (loading the model can take a minute)

{error}"""


class LogView(Widget):
    """The newest log lines that fit, newest last (drawn at paint time, when the height is known)."""

    def __init__(self, lines: Callable[[], Iterable[LogLine]], id: str) -> None:
        super().__init__(id=id)
        self._lines = lines

    def render(self) -> Text:
        rows = max(1, self.content_size.height)
        lines = list(self._lines())[-rows:]
        return Text("\n", no_wrap=True, overflow="ellipsis").join(render.log_line(line) for line in lines)


class DashboardApp(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "adaptive-spec"
    ENABLE_COMMAND_PALETTE = False  # every action has its own key, shown in the footer
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("p", "pin", "pin"),
        Binding("a", "auto", "auto"),
        Binding("r", "restart", "restart profile"),
        Binding("space", "pause", "pause"),
        Binding("slash", "filter", "filter"),
        Binding("s", "sort", "sort"),
        Binding("question_mark", "help", "help"),
        Binding("q", "quit", "quit"),
        Binding("escape", "clear_filter", show=False),
    ]

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
        self._chart_profiles: tuple[str, ...] = ()
        self._narrow = False
        self._table_shape: tuple[bool, int] | None = None
        self._table_rows: list[tuple[str, tuple[str | Text, ...]]] = []
        self.child_argv: list[str] | None = None  # `serve --tui`: the proxy this app starts and stops
        self.child: asyncio.subprocess.Process | None = None
        self.child_exit_code: int | None = None

    @property
    def _main(self) -> Screen[Any]:
        """The dashboard: the first screen; the detail and the dialogs are pushed over it."""
        return self.screen_stack[0]

    # ---- layout ----------------------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Static(id="status")
        yield Static(id="banner")
        profiles = Static(id="profiles")
        profiles.border_title = "profiles"
        yield profiles
        chart = Vertical(id="chart")
        chart.border_title = "acceptance │ decode tok/s, one point a second"
        yield chart
        sessions: DataTable[str | Text] = DataTable(id="sessions", cursor_type="row", zebra_stripes=True)
        sessions.border_title = "sessions"
        yield sessions
        yield Input(placeholder="filter sessions: session, client, project or profile (esc clears)", id="filter")
        log = LogView(lambda: self.dashboard.log, id="log")
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
        else:
            self.dashboard.apply(item.kind, item.payload, now)
            if item.kind == "EventsDropped":
                self._resync()

    def _connected(self, now: float, *, replay: bool) -> None:
        keep = self.dashboard
        self.dashboard = Dashboard()  # a fresh snapshot and history follow: rebuild from them
        for name, old in keep.profiles.items():  # but keep what the charts and log already showed
            self.dashboard._profile(name).chart.extend(old.chart)
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
        self.child = await asyncio.create_subprocess_exec(
            *self.child_argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # keys reach the TUI, not serve
        )
        assert self.child.stdout is not None
        async for raw in self.child.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            if line:
                self.dashboard.note(self.clock(), "serve", "serve", line)
                self.last_error = line
                self.dirty = True
        self.child_exit_code = await self.child.wait()
        self.dashboard.note(self.clock(), "fail", "serve", f"serve exited with code {self.child_exit_code}")
        self.last_error = f"serve exited with code {self.child_exit_code}: {self.last_error}"
        self.dirty = True

    async def stop_child(self) -> None:
        child = self.child
        if child is None or child.returncode is not None:
            return
        self.notify("stopping adaptive-spec serve and its llama-servers…")
        child.terminate()
        try:
            async with asyncio.timeout(30):
                await child.wait()
        except TimeoutError:
            child.kill()
            await child.wait()
        self.child_exit_code = child.returncode

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
        banner = self._main.query_one("#banner", Static)
        banner.set_class(not self.connected and not self.ever_connected, "-active")
        if not self.connected and not self.ever_connected:
            template = STARTING if self.child_argv and self.child_exit_code is None else NO_PROXY
            if self.last_error.startswith(("401", "403")):
                template = REFUSED
            banner.update(Text.from_markup(template.format(url=self.label, error=escape(self.last_error or "…"))))
        lines = Text("\n").join(render.profile_lines(v, now, narrow=self._narrow) for v in board.profiles.values())
        self._main.query_one("#profiles", Static).update(lines if board.profiles else Text("waiting for the proxy…"))
        self._draw_chart(now)
        self._draw_sessions()
        self._draw_log()
        if isinstance(self.screen, DetailScreen):
            self.screen.refresh_view()

    def _draw_chart(self, now: float) -> None:
        chart = self._main.query_one("#chart", Vertical)
        names = tuple(self.dashboard.profiles)
        if names != self._chart_profiles:
            self._chart_profiles = names
            chart.remove_children()
            for i, _name in enumerate(names):
                chart.mount(
                    Horizontal(
                        Label(id=f"chart-label-{i}", classes="chart-label"),
                        Sparkline([], id=f"chart-accept-{i}", summary_function=max),
                        Label(id=f"chart-speed-label-{i}", classes="chart-value speed"),
                        Sparkline([], id=f"chart-speed-{i}", summary_function=max, classes="speed"),
                        classes="chart-row",
                    )
                )
            return  # the rows are mounted after this frame: fill them in the next
        for i, view in enumerate(self.dashboard.profiles.values()):
            try:
                label = self._main.query_one(f"#chart-label-{i}", Label)
            except NoMatches:  # mounting not finished yet: the next frame draws it
                self.dirty = True
                return
            points = list(view.chart)
            rate, accept = view.live(now)
            word = "" if self._narrow else " accept"
            shown = render.pct(accept) if view.drafts else "—"
            label.update(Text.assemble((f"{view.name:<11.11}", "bold"), f"{word} {shown:>4} "))
            pad = [0.0] * max(0, CHART_MIN_POINTS - len(points))  # early on, time still flows at a readable pace
            self._main.query_one(f"#chart-accept-{i}", Sparkline).data = pad + [p.acceptance or 0.0 for p in points]
            self._main.query_one(f"#chart-speed-label-{i}", Label).update(f"{rate:6.1f} tok/s ")
            self._main.query_one(f"#chart-speed-{i}", Sparkline).data = pad + [p.tokens_per_s for p in points]

    def visible_sessions(self) -> list[Any]:
        views = list(self.dashboard.sessions.values())
        needle = self.filter_text.lower()
        if needle:
            views = [v for v in views if needle in f"{v.session_id} {v.client} {v.project} {v.profile or ''}".lower()]
        key = SORTS[self.sort]
        if key == "turns":
            views.sort(key=lambda v: len(v.turns), reverse=True)
        elif key == "accepted":
            views.sort(key=lambda v: v.accepted_share or -1.0, reverse=True)
        elif key == "tok/s":
            views.sort(key=lambda v: (v.last_turn.tokens_per_s or 0.0) if v.last_turn else 0.0, reverse=True)
        elif key == "profile":
            views.sort(key=lambda v: v.profile or "")
        else:
            views.sort(key=lambda v: v.last_active, reverse=True)
        return views

    def _draw_sessions(self) -> None:
        table = self._main.query_one("#sessions", DataTable)
        shape = (self._narrow, table.size.width)
        if self._table_shape != shape:
            self._table_shape, self._table_rows = shape, []
            table.clear(columns=True)
            for label, width in render.session_columns(self._narrow, table.size.width):
                table.add_column(label, width=width)
        selected = self.selected_session()
        views = self.visible_sessions()
        rows = [(view.session_id, render.session_cells(view, narrow=self._narrow)) for view in views]
        if rows != self._table_rows:  # rebuilding the table is most of a frame's cost: only when a row changed
            self._table_rows = rows
            table.clear()
            for key, cells in rows:
                table.add_row(*cells, key=key)
        live = sum(1 for v in views if v.in_flight)
        filt = f" · filter '{self.filter_text}'" if self.filter_text else ""
        table.border_title = f"sessions ({len(views)}, {live} active) · sort: {SORTS[self.sort]}{filt}"
        if selected is not None and selected in self.dashboard.sessions:
            with contextlib.suppress(RowDoesNotExist):  # filtered out: the cursor stays where it was
                table.move_cursor(row=table.get_row_index(selected))

    def _draw_log(self) -> None:
        self._main.query_one("#log", LogView).refresh()

    # ---- keys ------------------------------------------------------------------------------------------------
    def selected_session(self) -> str | None:
        if isinstance(self.screen, DetailScreen):
            return self.screen.session_id
        table = self._main.query_one("#sessions", DataTable)
        if not table.row_count:
            return None
        try:
            key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        except CellDoesNotExist:
            return None
        return str(key.value) if key.value is not None else None

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.data_table.id == "sessions" and event.row_key.value is not None:
            self.push_screen(DetailScreen(str(event.row_key.value)))

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
