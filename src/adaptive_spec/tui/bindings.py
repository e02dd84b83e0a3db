"""The keys, declared once: the dashboard binds them all, and the session detail the ones that act on a session or
on the view, run as the same actions of the app."""

from __future__ import annotations

from dataclasses import replace

from textual.binding import Binding, BindingType

PIN = Binding("p", "pin", "pin")
AUTO = Binding("a", "auto", "auto")
PAUSE = Binding("space", "pause", "pause")
HELP = Binding("question_mark", "help", "help")

DASHBOARD: list[BindingType] = [
    PIN,
    AUTO,
    Binding("r", "restart", "restart profile"),
    PAUSE,
    Binding("slash", "filter", "filter"),
    Binding("s", "sort", "sort"),
    HELP,
    Binding("q", "quit", "quit"),
    Binding("escape", "clear_filter", show=False),
]

DETAIL: list[BindingType] = [
    Binding("escape", "app.pop_screen", "back"),
    *(replace(key, action=f"app.{key.action}") for key in (PIN, AUTO, PAUSE, HELP)),
]
