"""The dashboard's panels that draw themselves from the picture: the banner shown until the first connection, the
chart rows per profile, the sessions table (rebuilt only when a row changed) and the log."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence

from rich.markup import escape
from rich.text import Text
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.widget import Widget
from textual.widgets import DataTable, Label, Sparkline, Static
from textual.widgets.data_table import CellDoesNotExist, RowDoesNotExist

from adaptive_spec.tui import render
from adaptive_spec.tui.log_lines import LogLine
from adaptive_spec.tui.profiles import ProfileView
from adaptive_spec.tui.sessions import SessionView

CHART_MIN_POINTS = 120  # the chart spans at least two minutes

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


class Banner(Static):
    """Until the view first connects: why there is nothing to show yet, and what to do about it."""

    def show(self, *, waiting: bool, url: str, error: str, starting: bool) -> None:
        self.set_class(waiting, "-active")
        if not waiting:
            return
        template = STARTING if starting else NO_PROXY
        if error.startswith(("401", "403")):
            template = REFUSED
        self.update(Text.from_markup(template.format(url=url, error=escape(error or "…"))))


class ChartPanel(Vertical):
    """Per profile, one row: its acceptance and its decode speed, one point a second."""

    def __init__(self, *, id: str) -> None:
        super().__init__(id=id)
        self._profiles: tuple[str, ...] = ()

    def draw(self, profiles: Mapping[str, ProfileView], now: float, *, narrow: bool) -> bool:
        """False when a row is not mounted yet, so the next frame must draw again. When the profiles change, the
        rows are mounted after this frame and filled from the next."""
        names = tuple(profiles)
        if names != self._profiles:
            self._profiles = names
            self.remove_children()
            for i, _name in enumerate(names):
                self.mount(
                    Horizontal(
                        Label(id=f"chart-label-{i}", classes="chart-label"),
                        Sparkline([], id=f"chart-accept-{i}", summary_function=max),
                        Label(id=f"chart-speed-label-{i}", classes="chart-value speed"),
                        Sparkline([], id=f"chart-speed-{i}", summary_function=max, classes="speed"),
                        classes="chart-row",
                    )
                )
            return True
        for i, view in enumerate(profiles.values()):
            try:
                label = self.query_one(f"#chart-label-{i}", Label)
            except NoMatches:  # mounting not finished yet: the next frame draws it
                return False
            points = list(view.chart)
            rate, accept = view.live(now)
            word = "" if narrow else " accept"
            shown = render.pct(accept) if view.drafts else "—"
            label.update(Text.assemble((f"{view.name:<11.11}", "bold"), f"{word} {shown:>4} "))
            pad = [0.0] * max(0, CHART_MIN_POINTS - len(points))  # early on, time still flows at a readable pace
            self.query_one(f"#chart-accept-{i}", Sparkline).data = pad + [p.acceptance or 0.0 for p in points]
            self.query_one(f"#chart-speed-label-{i}", Label).update(f"{rate:6.1f} tok/s ")
            self.query_one(f"#chart-speed-{i}", Sparkline).data = pad + [p.tokens_per_s for p in points]
        return True


class SessionTable(DataTable[str | Text]):
    """One row per session; the columns fit the width, and the rows are rebuilt only when one of them changed
    (rebuilding is most of a frame's cost)."""

    def __init__(self, *, id: str) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True)
        self._shape: tuple[bool, int] | None = None
        self._rows: list[tuple[str, tuple[str | Text, ...]]] = []

    def draw(self, views: Sequence[SessionView], *, narrow: bool, keep: str | None, title: str) -> None:
        """The cursor stays on `keep` (the session the detail shows), else on the session under it; one that is
        filtered out leaves the cursor where it was."""
        shape = (narrow, self.size.width)
        if self._shape != shape:
            self._shape, self._rows = shape, []
            self.clear(columns=True)
            for label, width in render.session_columns(narrow, self.size.width):
                self.add_column(label, width=width)
        selected = keep if keep is not None else self.selected()
        rows = [(view.session_id, render.session_cells(view, narrow=narrow)) for view in views]
        if rows != self._rows:
            self._rows = rows
            self.clear()
            for key, cells in rows:
                self.add_row(*cells, key=key)
        self.border_title = title
        if selected is not None:
            with contextlib.suppress(RowDoesNotExist):
                self.move_cursor(row=self.get_row_index(selected))

    def selected(self) -> str | None:
        """The session under the cursor."""
        if not self.row_count:
            return None
        try:
            key = self.coordinate_to_cell_key(self.cursor_coordinate).row_key
        except CellDoesNotExist:
            return None
        return str(key.value) if key.value is not None else None


class LogView(Widget):
    """The newest log lines that fit, newest last (drawn at paint time, when the height is known)."""

    def __init__(self, lines: Callable[[], Iterable[LogLine]], id: str) -> None:
        super().__init__(id=id)
        self._lines = lines

    def render(self) -> Text:
        rows = max(1, self.content_size.height)
        lines = list(self._lines())[-rows:]
        return Text("\n", no_wrap=True, overflow="ellipsis").join(render.log_line(line) for line in lines)
