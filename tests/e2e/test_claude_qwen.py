"""Claude Code and Qwen Code end to end through `adaptive-spec serve` (opt-in, as tests/e2e/test_agents.py), each asked
to create a file and then to change it, in one conversation.

What must hold on any model: every request answered (no proxy 4xx where llama-server takes the body: Claude Code's
mid-conversation system message, its betas and `?beta=true`), one session per conversation (Claude Code names it in
`X-Claude-Code-Session-Id`; Qwen Code names none, so the reply echo groups it), the side requests recognised as side,
the proxy's estimate of each follow-up turn's prefill within 15% of llama-server's `prompt_n`. Whether the file is
made and changed is recorded (the embedded models are small for agents this size: examples/README.md says what they
did).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.agents import ENABLED, client, records, run, summary
from tests.support.servers import ProxyProcess

if not ENABLED:
    pytest.skip("end-to-end agent tests are opt-in: ADAPTIVE_SPEC_E2E=1", allow_module_level=True)

pytestmark = pytest.mark.timeout(3600)

CREATE = "Create hello.py that prints hello."
EDIT = "Change hello.py so it prints bye."
# How far the estimate of a turn that continues its cached prefix may miss llama-server's prefilled tokens.
ESTIMATE_ERROR = 0.15


def _estimates_hold(recs: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(estimate, prompt_n) of the main-line turns that continued their session's cached prefix and are off by more
    than ESTIMATE_ERROR."""
    off = []
    for r in recs:
        timings = r.get("timings") or {}
        est, true = r.get("new_tokens_est"), timings.get("prompt_n")
        if r.get("side") or est is None or not true or not timings.get("cache_n"):
            continue
        if abs(est - true) > ESTIMATE_ERROR * true:
            off.append((est, true))
    return off


def _made(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


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
        "API_TIMEOUT_MS": "3600000",  # a first turn prefills ~12k tokens: minutes on a CPU
    }
    argv: list[str | Path] = [claude, "-p", "--dangerously-skip-permissions", "--max-turns", "6"]
    made = repo / "hello.py"
    made.unlink()
    first = run([*argv, CREATE], repo, env, stop_after=1800)
    created = _made(made)
    second = run([*argv, "--continue", EDIT], repo, env, stop_after=1500)
    recs = records(proxy, project)
    notes = f"created: {created!r}; after the edit: {_made(made)!r}\n" + (first.stdout + second.stdout)[-1500:]
    out = summary("claude-code", recs, 1, [first, second], notes=notes)
    answered = [r for r in recs if r["status"] != 499]  # a turn stopped mid-answer leaves one cancelled request
    assert answered and all(r["status"] == 200 for r in answered), [(r["path"], r["status"], r["error"]) for r in recs]
    assert {r["api"] for r in recs} <= {"messages", "count_tokens", "other"}, out
    gen = [r for r in recs if r["api"] == "messages"]
    assert {r["session_source"] for r in gen} == {"header:x-claude-code-session-id"}, out
    # Each `claude -p` run is a conversation of its own unless --continue carries it on: at most the two runs.
    assert 1 <= out["sessions_found"] <= 2, out
    assert _estimates_hold(gen) == [], out


def _qwen_settings(home: Path) -> None:
    folder = home / ".qwen"
    folder.mkdir(parents=True, exist_ok=True)
    settings = {
        # Its stream guard (240 s): the proxy's keep-alives reset it; this is only the safety net.
        "generationConfig": {"streamIdleTimeoutMs": 3_600_000, "timeout": 3_600_000},
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
    }
    made = repo / "hello.py"
    made.unlink()
    first = run([qwen, "--yolo", CREATE], repo, env, stop_after=1800)
    created = _made(made)
    second = run([qwen, "--yolo", "--continue", EDIT], repo, env, stop_after=1500)
    recs = records(proxy, project)
    notes = f"created: {created!r}; after the edit: {_made(made)!r}\n" + (first.stdout + second.stdout)[-1500:]
    out = summary("qwen-code", recs, 1, [first, second], notes=notes)
    answered = [r for r in recs if r["status"] != 499]
    assert answered and all(r["status"] == 200 for r in answered), [(r["path"], r["status"], r["error"]) for r in recs]
    gen = [r for r in recs if r["api"] == "chat"]
    assert out["sessions_found"] <= 2, out  # one per run at most: no session header, the echo groups each run
    assert _estimates_hold(gen) == [], out
