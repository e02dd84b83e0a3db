"""Claude Code and Qwen Code end to end through `adaptive-spec serve` (opt-in, as tests/e2e/test_agents.py), each asked
to create a file and then to change it, in one conversation.

What must hold on any model: every request answered (no proxy 4xx where llama-server takes the body: Claude Code's
mid-conversation system message, its betas and `?beta=true`), one session per conversation (Claude Code names it in
`X-Claude-Code-Session-Id`; Qwen Code names none, so the reply echo groups it), the proxy's estimate of the follow-up
turns' prefill within 15% of llama-server's `prompt_n` (the median; no turn off by half). Qwen Code's memory request
as a side request is checked on its shape (tests/integration/agents/test_qwen_code.py): it did not come in the runs
here. Whether the file is made and changed is recorded (the embedded models are small for agents this size:
examples/README.md says what they did).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.processes.agents import CREATE, EDIT, client, estimates_off, file_text, records, run, summary
from tests.support.processes.servers import ProxyProcess


def test_claude_code_creates_then_changes_a_file(proxy: ProxyProcess, workspace: tuple[Path, dict[str, str]]) -> None:
    repo, env = workspace
    project = "e2e-claude-code"
    claude = client("claude")
    env = {
        **env,
        "ANTHROPIC_BASE_URL": f"{proxy.base}/p/{project}",
        "ANTHROPIC_AUTH_TOKEN": "local",
        "ANTHROPIC_MODEL": "local",
        "ANTHROPIC_SMALL_FAST_MODEL": "local",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "IS_SANDBOX": "1",  # --dangerously-skip-permissions as root
        # As examples/claude-code.sh: its stream watchdog (300 s) counts no keep-alive, and a first turn prefills
        # 12-18k tokens, minutes on a CPU; its other timers the keep-alives reset (examples/README.md).
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000",
        # As examples/claude-code.sh sets them: the window of one slot, and room in it for an 8k answer.
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": "32768",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "8192",
    }
    argv: list[str | Path] = [claude, "-p", "--dangerously-skip-permissions", "--max-turns", "6"]
    made = repo / "hello.py"
    made.unlink()
    first = run([*argv, CREATE], repo, env, stop_after=1800)
    created = file_text(made)
    second = run([*argv, "--continue", EDIT], repo, env, stop_after=1500)
    recs = records(proxy, project)
    notes = f"created: {created!r}; after the edit: {file_text(made)!r}\n" + (first.stdout + second.stdout)[-1500:]
    out = summary("claude-code", recs, 1, [first, second], notes=notes)
    answered = [r for r in recs if r["status"] != 499]  # a turn stopped mid-answer leaves one cancelled request
    assert answered and all(r["status"] == 200 for r in answered), [(r["path"], r["status"], r["error"]) for r in recs]
    assert {r["api"] for r in recs} <= {"messages", "count_tokens", "other"}, out
    gen = [r for r in recs if r["api"] == "messages"]
    assert {r["session_source"] for r in gen} == {"header:x-claude-code-session-id"}, out
    # Each `claude -p` run is a conversation of its own unless --continue carries it on: at most the two runs.
    assert 1 <= out["sessions_found"] <= 2, out
    assert estimates_off(gen) == [], out


def _qwen_settings(home: Path) -> None:
    folder = home / ".qwen"
    folder.mkdir(parents=True, exist_ok=True)
    settings = {
        # Its stream guard (240 s) and request timeout the proxy's keep-alives reset (examples/README.md): not raised.
        "usageStatisticsEnabled": False,
        "telemetry": {"enabled": False},
    }
    (folder / "settings.json").write_text(json.dumps(settings))


def test_qwen_code_creates_then_changes_a_file(proxy: ProxyProcess, workspace: tuple[Path, dict[str, str]]) -> None:
    repo, env = workspace
    project = "e2e-qwen-code"
    qwen = client("qwen")
    _qwen_settings(Path(env["HOME"]))
    env = {
        **env,
        "OPENAI_BASE_URL": f"{proxy.base}/p/{project}/v1",
        "OPENAI_API_KEY": "local",
        "OPENAI_MODEL": "local",
        "QWEN_STREAM_MAX_LIFETIME_MS": "3600000",  # its 900 s cap on a stream's whole wait, which nothing resets
    }
    made = repo / "hello.py"
    made.unlink()
    first = run([qwen, "--yolo", CREATE], repo, env, stop_after=1800)
    created = file_text(made)
    second = run([qwen, "--yolo", "--continue", EDIT], repo, env, stop_after=1500)
    recs = records(proxy, project)
    notes = f"created: {created!r}; after the edit: {file_text(made)!r}\n" + (first.stdout + second.stdout)[-1500:]
    out = summary("qwen-code", recs, 1, [first, second], notes=notes)
    answered = [r for r in recs if r["status"] != 499]
    assert answered and all(r["status"] == 200 for r in answered), [(r["path"], r["status"], r["error"]) for r in recs]
    gen = [r for r in recs if r["api"] == "chat"]
    # No session header: the echo groups the answered requests, --continue's too, and an attempt Qwen Code gave up on
    # before any answer shares its retry's session.
    assert len({r["session_id"] for r in gen}) == 1, out
    assert estimates_off(gen) == [], out
