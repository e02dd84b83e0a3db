"""Gemini CLI end to end through `adaptive-spec serve` (opt-in, as tests/e2e/test_agents.py): asked to create a file
and then, resuming its session, to change it, through Google's Gemini API (`GOOGLE_GEMINI_BASE_URL`, the proxy
translating it for llama-server) with examples/gemini-settings.json as its settings.

What must hold on any model: every request answered 200 (its router's classifier asks for JSON under a schema in
Google's type names; any `gemini-*` model name it asks for is served and kept in the record), one session for the
conversation (it names none: the classifier of its first turn joins by the opening turn, the rest by the reply echo),
the classifier of the second turn a side request of it, and every cold prompt's estimate within 15% of llama-server's
`prompt_n` (follow-ups as for the other agents). Whether the file is made and changed is recorded: on the 0.5B the model
names tools as text (examples/README.md says what it did).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.support.processes.agents import (
    CREATE,
    EDIT,
    ROOT,
    client,
    estimates_off,
    file_text,
    first_turns_off,
    records,
    run,
    summary,
)
from tests.support.processes.servers import ProxyProcess


def test_gemini_cli_creates_then_changes_a_file(proxy: ProxyProcess, workspace: tuple[Path, dict[str, str]]) -> None:
    repo, env = workspace
    project = "e2e-gemini-cli"
    gemini = client("gemini")
    settings = Path(env["HOME"]) / ".gemini"
    settings.mkdir()
    shutil.copy(ROOT / "examples" / "gemini-settings.json", settings / "settings.json")
    # No timeout of its own is raised: it waits for a first token as long as it takes (a 9.6k-token first turn was
    # answered after 164 s on the 0.5B, the proxy's keep-alive comments meanwhile).
    env = {**env, "GOOGLE_GEMINI_BASE_URL": f"{proxy.base}/p/{project}", "GEMINI_API_KEY": "local"}
    made = repo / "hello.py"
    made.unlink()
    first = run([gemini, "-p", CREATE, "--yolo"], repo, env, stop_after=1800)
    created = file_text(made)
    second = run([gemini, "-p", EDIT, "--yolo", "--resume", "latest"], repo, env, stop_after=1500)
    recs = records(proxy, project)
    notes = f"created: {created!r}; after the edit: {file_text(made)!r}\n" + (first.stdout + second.stdout)[-1500:]
    out = summary("gemini-cli", recs, 1, [first, second], notes=notes)
    answered = [r for r in recs if r["status"] != 499]  # a turn stopped mid-answer leaves one cancelled request
    assert answered and all(r["status"] == 200 for r in answered), [(r["path"], r["status"], r["error"]) for r in recs]
    assert {r["api"] for r in recs} <= {"gemini", "gemini_count_tokens", "gemini_models", "other"}, out
    gen = [r for r in recs if r["api"] == "gemini"]
    assert all(r["model"].startswith("gemini-") for r in gen), out  # as it asked, served by the profile's model
    assert {r["client"] for r in gen} == {"gemini-cli"}, out
    assert out["sessions_found"] == 1, out
    assert out["side_requests"] >= 1, out  # the second turn's classifier
    assert first_turns_off(gen) == [], out
    assert estimates_off(gen) == [], out
