"""The screens one key away from the dashboard: a session's turns with its live text, the help, and the small
dialogs that pick a profile or confirm a restart."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen, Screen
from textual.widgets import DataTable, Footer, Label, OptionList, Static
from textual.widgets.option_list import Option

from adaptive_spec.tui import bindings, render
from adaptive_spec.tui.model import Dashboard

HELP = """\
[b]adaptive-spec tui[/b] — what the proxy's router does, live

[b]Profiles[/b]  one llama-server each; slots busy/total and queued requests; decode tok/s and acceptance
           (share of output tokens that came from accepted drafts) over the last second and since the view started.
[b]Chart[/b]     per profile, one point a second: acceptance and decode speed over the last 10 minutes.
[b]Sessions[/b]  one row per agent conversation: its profile now (● = a request in flight), the router's
           estimated copyability, measured acceptance of the last turn / the whole session, moves, last reason.
[b]Log[/b]       starts, finishes, failures (red), KV handoffs, policy reloads, profile health.

Every drafted/accepted figure is summed from llama-server's own timings of each request.

[b]enter[/b] session detail   [b]p[/b] pin session to a profile   [b]a[/b] back to automatic routing
[b]r[/b] restart a profile   [b]s[/b] sort   [b]/[/b] filter   [b]space[/b] pause the view   [b]q[/b] quit
In the detail: [b]esc[/b] back, [b]p[/b]/[b]a[/b] as above. Live text needs [b]serve --feed-content[/b]; llama-server
marks no token as drafted, so highlighted tokens are inferred from the change of draft_n_accepted between chunks.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q,question_mark", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(HELP)
            yield Label("esc closes", classes="dim")


class PickScreen(ModalScreen[str | None]):
    """Choose one of `choices` (id, label); dismisses with the id, or None on escape."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "cancel")]

    def __init__(self, title: str, choices: list[tuple[str, str]]) -> None:
        super().__init__()
        self._title = title
        self._choices = choices

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self._title)
            yield OptionList(*[Option(label, id=choice) for choice, label in self._choices])

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "yes"),
        Binding("n,escape", "answer(False)", "no"),
    ]

    def __init__(self, question: str) -> None:
        super().__init__()
        self._question = question

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self._question)
            yield Label("y yes   n no")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)


class DetailScreen(Screen[None]):
    """One session: a row per turn with llama-server's figures and the router's estimate beside the measured
    acceptance, and the text of its request in flight."""

    BINDINGS: ClassVar[list[BindingType]] = bindings.DETAIL

    def __init__(self, session_id: str, dashboard: Callable[[], Dashboard]) -> None:
        super().__init__()
        self.session_id = session_id
        self._dashboard = dashboard  # a getter: the app starts a fresh picture when it reconnects
        self._rows = -1
        self._cursor = 0

    def compose(self) -> ComposeResult:
        yield Static(id="detail-head")
        table: DataTable[str | Text] = DataTable(id="turns", cursor_type="row", zebra_stripes=True)
        for label, width in render.TURN_COLUMNS:
            table.add_column(label, width=width)
        yield table
        yield Static(id="turn-reason")
        live = Static(id="live")
        live.border_title = "answer · green: from accepted drafts (inferred from draft_n_accepted between chunks)"
        yield live
        yield Footer()

    def on_mount(self) -> None:
        self.refresh_view()

    @property
    def dashboard(self) -> Dashboard:
        return self._dashboard()

    def refresh_view(self) -> None:
        view = self.dashboard.sessions.get(self.session_id)
        head = self.query_one("#detail-head", Static)
        if view is None:
            head.update(f"session {self.session_id} is gone")
            return
        text = Text(f" {view.session_id} ", style="bold reverse")
        text.append(f"  {view.client} · {view.project} · {len(view.turns)} turns · on {view.profile or '—'}")
        text.append(f" · est. copyable {render.pct(view.est_copyability)}")
        text.append(
            f" · accepted {view.draft_n_accepted:,}/{view.predicted_n:,} output tok ({render.pct(view.accepted_share)})"
        )
        text.append(f" · drafted {view.draft_n:,} · moves {view.moves}")
        head.update(text)
        table = self.query_one("#turns", DataTable)
        at_end = table.cursor_row >= table.row_count - 1
        table.clear()
        for i, row in enumerate(view.turns, 1):
            table.add_row(*render.turn_cells(i, row), key=row.request_id)
        if table.row_count:
            table.move_cursor(row=table.row_count - 1 if at_end or self._rows < 0 else self._cursor)
        self._rows = table.row_count
        self._show_reason()
        live = self.dashboard.live.get(view.in_flight) if view.in_flight else view.last_text
        self.query_one("#live", Static).update(
            render.live_text(live, enabled=self.dashboard.live_text, finished=view.in_flight is None)
        )

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._cursor = event.cursor_row
        self._show_reason()

    def _show_reason(self) -> None:
        view = self.dashboard.sessions.get(self.session_id)
        if view is None or not view.turns:
            return
        index = min(max(self._cursor, 0), len(view.turns) - 1)
        self.query_one("#turn-reason", Static).update(render.turn_reason(index + 1, view.turns[index]))
