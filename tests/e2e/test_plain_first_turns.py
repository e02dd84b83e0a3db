"""First turns with plain settings (opt-in, as tests/e2e/test_agents.py): each agent given only its base URL, key and
model, none of its timeouts raised, asked to create a file through `adaptive-spec serve`.

What must hold: the first turn is not given up (no request the client disconnected from, no attempt before the
answered one) and nothing fails in the proxy. The client's own end is recorded, not asserted: on a small model an
agent may run on (Claude Code's subagents) until the run is stopped. On a CPU the first turn prefills
~12-18k tokens for minutes: the proxy's keep-alives (requests/forwarding/keepalive.py) are what keeps each agent
waiting, as far as its timers can be reset (examples/README.md has the table; a total wait they cannot reset is named
there and by `serve` at start). The older Claude Code is the one under ADAPTIVE_SPEC_E2E_CLIENTS/npm-claude-old
(installed with `npm install --prefix …/npm-claude-old @anthropic-ai/claude-code@2.1.197`); without it that test is
skipped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes.agents import CLIENTS, CREATE, GENERATING, client, file_text, records, run, summary
from tests.support.processes.servers import ProxyProcess


def _given_up(recs: list[dict[str, Any]]) -> list[tuple[str, int, float | None]]:
    """The requests the client gave up on (499) or the proxy failed (5xx): (path, status, milliseconds to the end).
    A 400 is the model's own doing (a small model's subagent that overflows its window), not a wait given up."""
    return [(r["path"], r["status"], r.get("total_ms")) for r in recs if r["status"] == 499 or r["status"] >= 500]


def _first_turn(agent: str, proxy: ProxyProcess, project: str, done: Any, made: Path) -> dict[str, Any]:
    recs = records(proxy, project)
    notes = f"created: {file_text(made)!r}\n" + (done.stdout + done.stderr)[-1500:]
    out = summary(agent, recs, 1, [done], notes=notes)
    gen = [r for r in recs if r["api"] in GENERATING]
    assert gen, out
    assert _given_up(recs) == [], out  # nothing given up, nothing failed
    assert gen[0]["status"] == 200, out  # the first turn's request answered, the first time
    assert out["first_request"] is not None and out["first_request"]["attempts_before"] == 0, out
    return out


def _claude(proxy: ProxyProcess, workspace: tuple[Path, dict[str, str]], claude: Path, agent: str) -> None:
    repo, env = workspace
    project = f"e2e-plain-{agent}"
    env = {
        **env,
        "ANTHROPIC_BASE_URL": f"{proxy.base}/p/{project}",
        "ANTHROPIC_AUTH_TOKEN": "local",
        "ANTHROPIC_MODEL": "local",
        "IS_SANDBOX": "1",  # --dangerously-skip-permissions as root
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # nothing leaves the machine
    }
    made = repo / "hello.py"
    made.unlink()
    done = run([claude, "-p", "--dangerously-skip-permissions", "--max-turns", "4", CREATE], repo, env, stop_after=900)
    _first_turn(agent, proxy, project, done, made)


def test_claude_code_first_turn_with_plain_settings(
    proxy: ProxyProcess, workspace: tuple[Path, dict[str, str]]
) -> None:
    _claude(proxy, workspace, client("claude"), "claude-code-plain")


def test_older_claude_code_first_turn_with_plain_settings(
    proxy: ProxyProcess, workspace: tuple[Path, dict[str, str]]
) -> None:
    claude = CLIENTS / "npm-claude-old" / "node_modules" / ".bin" / "claude"
    if not claude.exists():
        pytest.skip(f"no older Claude Code at {claude}")
    _claude(proxy, workspace, claude, "claude-code-old-plain")


def test_qwen_code_first_turn_with_plain_settings(proxy: ProxyProcess, workspace: tuple[Path, dict[str, str]]) -> None:
    repo, env = workspace
    project = "e2e-plain-qwen-code"
    settings = Path(env["HOME"]) / ".qwen" / "settings.json"  # no statistics sent; its timeouts as they come
    settings.parent.mkdir(parents=True)
    settings.write_text(json.dumps({"usageStatisticsEnabled": False, "telemetry": {"enabled": False}}))
    env = {
        **env,
        "OPENAI_BASE_URL": f"{proxy.base}/p/{project}/v1",
        "OPENAI_API_KEY": "local",
        "OPENAI_MODEL": "local",
    }
    made = repo / "hello.py"
    made.unlink()
    # At most four model turns, as Claude Code's --max-turns 4 above: a bound on the run, not on any wait.
    done = run([client("qwen"), "--yolo", "--max-session-turns", "4", CREATE], repo, env, stop_after=900)
    _first_turn("qwen-code-plain", proxy, project, done, made)
