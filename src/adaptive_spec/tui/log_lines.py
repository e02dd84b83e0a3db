"""The log pane's wording: one line for each start, finish, failure, KV handoff, remote prefill, pin and profile
change, naming the session or server it is about."""

from __future__ import annotations

from dataclasses import dataclass

from adaptive_spec.telemetry.events import HandoffDone, RemotePrefillDone, RequestStarted
from adaptive_spec.tui.sessions import TurnRow


@dataclass(frozen=True, slots=True)
class LogLine:
    at_unix: float
    kind: str  # start, finish, fail, handoff, policy, profile, note
    who: str
    text: str


def short(session_id: str | None) -> str:
    if not session_id:
        return "-"
    return session_id if len(session_id) <= 12 else session_id[:11] + "…"


def started(event: RequestStarted) -> str:
    return f"→ {event.profile}" + (f"  {event.reason}" if event.reason else "")


def finished(row: TurnRow) -> tuple[str, str]:
    """(kind, text) for a request's end: what it produced, how much came from drafts, how fast; or why it failed."""
    if row.outcome != "finished":
        return "fail", f"✗ {row.status} {row.error or 'failed'}"
    text = f"✓ {row.predicted_n} tok"
    if row.draft_n:
        share = f" ({row.draft_n_accepted / row.predicted_n:.0%})" if row.predicted_n else ""
        text += f", {row.draft_n_accepted} from drafts{share}"
    if row.tokens_per_s:
        text += f", {row.tokens_per_s:.1f} tok/s"
    if row.ttst_ms is not None:
        text += f", TTST {row.ttst_ms:.0f} ms"
    if row.prefill_error is not None:  # how far the route's prefill estimate was from llama-server's time
        text += f", prefill est {row.prefill_error:+.0%} ({row.estimate_basis or 'prior'})"
    return "finish", text + f" on {row.profile}"


def handoff(event: HandoffDone) -> str:
    ends = [(event.from_profile, event.from_replica), (event.to_profile, event.to_replica)]
    moved = " → ".join(f"{name}#{r}" if r else name for name, r in ends)  # replica #0 (or no pool): the name
    if event.ok:
        ms = (event.save_s + event.restore_s) * 1000
        return f"KV handed over {moved}: {event.tokens:,} tok in {ms:.0f} ms"
    return f"KV handoff {moved} failed ({event.error}); re-prefills"


def remote_prefill(event: RemotePrefillDone) -> str:
    """One log line for a remote prefill (`serve --pp-server`): what came back and how long each step took."""
    if not event.ok:
        return f"remote prefill failed ({event.reason}: {event.error}); prefilled here"
    steps = " · ".join(
        f"{name} {seconds * 1000:.0f} ms"
        for name, seconds in (
            ("prefill", event.remote_prefill_s),
            ("transfer", event.transfer_s),
            ("restore", event.restore_s),
        )
    )
    megabytes = event.bytes / 1e6
    return f"remote prefill: {event.tokens:,} tok, {megabytes:,.1f} MB back to {event.profile} ({steps})"


def pinned(profile: str | None) -> str:
    what = f"pinned to {profile}" if profile else "back to automatic routing"
    return what + " (from its next turn)"
