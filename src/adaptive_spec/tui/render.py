"""How the dashboard's figures read on screen: cells, lines and colours (Rich text; no widgets, no I/O)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from rich.text import Text

from adaptive_spec.tui.log_lines import LogLine
from adaptive_spec.tui.model import Dashboard
from adaptive_spec.tui.pools import ReplicaView
from adaptive_spec.tui.profiles import ProfileView
from adaptive_spec.tui.sessions import LiveRequest, SessionView, TurnRow

BLOCKS = "▁▂▃▄▅▆▇█"
DASH = "—"


def pct(share: float | None) -> str:
    return DASH if share is None else f"{share:.0%}"


def num(value: float | None, digits: int = 1) -> str:
    if value is None:
        return DASH
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:,.{digits}f}"  # fits the narrow speed columns


def ms(value: float | None) -> str:
    if value is None:
        return DASH
    if value >= 100_000:
        return f"{value / 1000:.0f} s"
    return f"{value / 1000:.1f} s" if value >= 1000 else f"{value:.0f} ms"


def short_id(session_id: str, width: int = 14) -> str:
    return session_id if len(session_id) <= width else session_id[: width - 1] + "…"


def spark(values: Sequence[float], width: int, top: float | None = None) -> str:
    """A block-character sparkline of the last `width` values, scaled to `top` (or their maximum)."""
    values = list(values)[-width:]
    if not values:
        return ""
    peak = top if top is not None else max(values)
    if peak <= 0:
        return BLOCKS[0] * len(values)
    last = len(BLOCKS) - 1
    return "".join(BLOCKS[min(last, max(0, round(v / peak * last)))] for v in values)


def spec_label(view: ProfileView) -> str:
    types = [t for t in view.spec_types if t not in ("", "none")]
    return ",".join(types) if types else "none"


def profile_line(view: ProfileView, now: float, *, narrow: bool) -> Text:
    """One profile: health, what it drafts with, slots and queue, the 1-second and since-start figures."""
    rate, accept = view.live(now)
    line = Text()
    line.append("● " if view.up else "○ ", style="green" if view.up else "bold red")
    line.append(f"{view.name:<10.10}", style="bold")
    line.append(f" {spec_label(view):<{12 if narrow else 24}.{12 if narrow else 24}}", style="cyan")
    slots = f"{view.busy}/{view.slots}" if view.slots is not None else f"{view.busy}/?"
    if narrow and view.queued:
        slots += f"+{view.queued}"  # requests waiting for a slot
    line.append(f" slots {slots:<5}")
    if not narrow:
        line.append(f" queue {view.queued:<3}", style="yellow" if view.queued else "")
    line.append(f" {rate:6.1f} tok/s" if not narrow else f" {rate:5.1f} t/s")
    if view.drafts and narrow:
        line.append(f" acc {pct(accept):>4}", style="green" if accept else "")
        line.append(f" / {pct(view.acceptance):>4}")
    elif view.drafts:
        line.append(f"  accept {pct(accept):>4} (1 s)", style="green" if accept else "")
        line.append(f"  {pct(view.acceptance):>4} since start")
    else:
        line.append("  no drafting", style="dim")
    if not view.up and view.reason:
        line.append(f"  down: {view.reason}", style="red")
    return line


def profile_lines(view: ProfileView, now: float, *, narrow: bool) -> Text:
    """The profile's line, and under it one line per server of its pool (when it has several)."""
    lines = [profile_line(view, now, narrow=narrow)]
    if len(view.replicas) > 1:
        lines += [replica_line(r, drafts=view.drafts, narrow=narrow) for _, r in sorted(view.replicas.items())]
    return Text("\n").join(lines)


def replica_line(view: ReplicaView, *, drafts: bool, narrow: bool) -> Text:
    """One server of a pool, indented under its profile: health, address, slots in use, requests, acceptance."""
    line = Text("  ")
    line.append("● " if view.up else "○ ", style="green" if view.up else "bold red")
    address = view.base_url.removeprefix("http://").removeprefix("https://")
    width = 18 if narrow else 28
    line.append(f"#{view.index} {address:<{width}.{width}}", style="dim")
    slots = f"{min(len(view.in_flight), view.slots or len(view.in_flight))}/{view.slots or '?'}"
    line.append(f" slots {slots:<5} req {view.requests:<6}")
    if drafts:
        line.append(f" acc {pct(view.acceptance):>4}", style="green" if view.acceptance else "")
    if not view.up and view.reason:
        line.append(f"  down: {view.reason}", style="red")
    return line


def session_cells(view: SessionView, *, narrow: bool) -> tuple[str | Text, ...]:
    last = view.last_turn
    profile = Text(view.profile or DASH, style="bold" if view.in_flight else "")
    if view.pinned:
        profile.append(" pin" if view.pinned == view.profile else f" pin→{view.pinned}", style="yellow")
    if view.in_flight:
        profile.append(" ●", style="green")
    accepted = f"{pct(last.accepted_share if last else None)} / {pct(view.accepted_share)}"
    speed = num(last.tokens_per_s if last else None)
    if narrow:
        return (short_id(view.session_id, 14), view.client[:8], str(len(view.turns)), profile, accepted, speed)
    client = view.client if len(view.client) <= 10 else view.client[:9] + "…"
    reason = Text((view.last_reason or "").replace("\n", " "), no_wrap=True, overflow="ellipsis")
    return (
        short_id(view.session_id),
        client,
        view.project,
        str(len(view.turns)),
        profile,
        pct(view.est_copyability),
        accepted,
        speed,
        str(view.moves),
        reason,
    )


REASON_CHARS = 64  # the whole reason is in the session's detail
# (label, width): fixed widths, so a column does not jump as the values in it change
SESSION_COLUMNS_WIDE = (
    ("session", 14),
    ("client", 10),
    ("project", 9),
    ("turns", 5),
    ("profile", 14),
    ("copyable", 8),
    ("acc last/all", 12),
    ("tok/s", 5),
    ("moves", 5),
    ("last decision", REASON_CHARS),  # widened to what the terminal leaves, see session_columns()
)


def session_columns(narrow: bool, table_width: int) -> list[tuple[str, int]]:
    """The sessions table's columns; in a wide table the last decision takes whatever width the others leave."""
    if narrow:
        return list(SESSION_COLUMNS_NARROW)
    columns = list(SESSION_COLUMNS_WIDE)
    fixed = sum(width + 2 for _, width in columns[:-1]) + 2  # each cell has one column of padding either side
    columns[-1] = (columns[-1][0], max(16, table_width - fixed - 2))  # the border
    return columns


SESSION_COLUMNS_NARROW = (
    ("session", 14),
    ("client", 8),
    ("turns", 5),
    ("profile", 16),
    ("acc last/all", 12),
    ("tok/s", 6),
)


def turn_cells(index: int, row: TurnRow) -> tuple[str | Text, ...]:
    handoff = DASH
    if row.handoff_tokens is not None and not row.handoff_ok:
        handoff = "failed: prefill"
    elif row.handoff_tokens is not None and row.handoff_reused is not None:
        handoff = f"{row.handoff_tokens:,}→{row.handoff_reused:,} tok"  # restored → reused
    elif row.handoff_tokens is not None:
        handoff = f"{row.handoff_tokens:,} tok {num(row.handoff_ms, 0)}ms"
    elif row.moved_from:
        handoff = "re-prefill"
    status = Text("✓", style="green") if row.outcome == "finished" else Text(f"✗ {row.status}", style="bold red")
    return (
        str(index),
        status,
        row.profile,
        f"{row.prompt_n:,}",
        f"{row.cache_n:,}",
        f"{row.predicted_n:,}",
        f"{row.draft_n:,}",
        f"{row.draft_n_accepted:,}",
        num(row.tokens_per_s),
        ms(row.ttft_ms),
        ms(row.ttst_ms),
        f"{pct(row.est_accepted_share)} / {pct(row.accepted_share)}",
        handoff,
    )


TURN_COLUMNS = (
    ("#", 2),
    ("", 3),
    ("profile", 10),
    ("prompt", 6),
    ("cached", 6),
    ("out", 5),
    ("drafted", 7),
    ("accepted", 8),
    ("tok/s", 5),
    ("TTFT", 6),
    ("TTST", 6),
    ("est / meas", 10),
    ("handoff", 15),
)


def turn_reason(index: int, row: TurnRow) -> Text:
    """The whole routing reason of one turn (and its error, for a failed one)."""
    text = Text(f"turn {index} → {row.profile} ({row.route or 'not routed'}): ", style="bold")
    # What the proxy changed in the request comes first: the box is a few lines high, and the reason is long.
    if row.repeat_guard:
        text.append(f"repeated call: {row.repeat_guard}; ", style="bold yellow")
    if row.repaired:
        text.append(f"rewritten for llama-server: {row.repaired}; ", style="yellow")
    if row.setting is not None:
        text.append(f"ran with speculation {row.setting}; ", style="bold")
    if row.handoff_tokens is not None and row.handoff_reused is not None:
        style = "bold red" if row.handoff_reused < row.handoff_tokens // 2 else "bold"
        text.append(f"handoff restored {row.handoff_tokens:,}, reused {row.handoff_reused:,}; ", style=style)
    text.append(row.reason or "no routing decision (not a generating request, or routing is off)")
    if row.error:
        text.append(f"\nerror: {row.error}", style="bold red")
    return text


_LOG_STYLES = {
    "fail": "bold red",
    "handoff": "magenta",
    "policy": "yellow",
    "profile": "cyan",
    "note": "yellow",
    "serve": "dim",
}


def log_line(line: LogLine) -> Text:
    stamp = time.strftime("%H:%M:%S", time.localtime(line.at_unix))
    text = Text(f"{stamp} ", style="dim", no_wrap=True, overflow="ellipsis")
    text.append(f"{line.who:<12.12} ", style="bold")
    text.append(line.text, style=_LOG_STYLES.get(line.kind, ""))
    return text


def live_text(live: LiveRequest | None, *, enabled: bool, finished: bool = False, lines: int = 7) -> Text:
    """The answer's text as it streams (its last `lines` lines), accepted-draft pieces highlighted."""
    if live is None:
        return Text("no request of this session is in flight", style="dim")
    what = "last answer" if finished else "streaming"
    head = Text(f"{what} on {live.profile}: {live.predicted_n} tok, {live.draft_n_accepted} from drafts  ", "bold")
    if not enabled:
        head.append("(live text is off: start serve with --feed-content to see it)", style="dim")
        return head
    body = Text()
    for chunk, drafted in live.text:
        body.append(chunk, style="black on green" if drafted else "")
    tail = body.split("\n")[-lines:]
    return Text("\n").join([head, *tail])


def status_line(board: Dashboard, *, url: str, connected: bool, since: float | None, paused: bool, now: float) -> Text:
    text = Text(" adaptive-spec ", style="bold reverse")
    text.append(f" {url} ")
    if connected and since is not None:
        text.append(f" connected {_duration(now - since)} ", style="green")
    elif connected:
        text.append(" replay ", style="cyan")
    else:
        text.append(" disconnected ", style="bold red")
    text.append(f" {board.requests_total} requests")
    if board.failed_total:
        text.append(f", {board.failed_total} failed", style="red")
    if board.dropped_events:
        text.append(f"  {board.dropped_events} events dropped (resynced)", style="yellow")
    if board.policy_sources is not None:
        names = [source.replace("\\", "/").rsplit("/", 1)[-1] for source in board.policy_sources]
        text.append(f" policy {' + '.join(names) if names else 'built-in'}", style="dim")
    if paused:
        text.append("  PAUSED (space resumes)", style="bold yellow")
    return text


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
