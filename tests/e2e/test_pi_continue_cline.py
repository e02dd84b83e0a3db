"""pi, Continue CLI and Cline CLI end to end through `adaptive-spec serve` (opt-in, as tests/e2e/test_agents.py), each
asked to create a file and then, continuing its conversation, to change it, with its example from examples/.

What must hold on any model: every request answered 200, one session for each conversation (pi names it in its
affinity headers, which examples/pi-models.json turns on; Continue CLI and Cline name none, so the reply echo groups
them; Cline resumes a task only in its terminal UI, so its change is a second task), the agent named in the record,
its first turn's estimate within 15% of llama-server's `prompt_n` and its follow-ups as for the other agents. Whether
the file is made and changed is recorded (examples/README.md says what each did on the embedded models).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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

EXAMPLE_BASE = "http://127.0.0.1:8088/p/myproject/v1"


def _check(agent: str, recs: list[dict[str, Any]], out: dict[str, Any], conversations: int = 1) -> None:
    answered = [r for r in recs if r["status"] != 499]  # a turn stopped mid-answer leaves one cancelled request
    assert answered and all(r["status"] == 200 for r in answered), [(r["path"], r["status"], r["error"]) for r in recs]
    gen = [r for r in recs if r["api"] == "chat"]
    assert gen and {r["client"] for r in gen} == {agent}, out
    assert out["sessions_found"] == conversations, out
    assert first_turns_off(gen) == [], out
    assert estimates_off(gen) == [], out


def test_pi_creates_then_changes_a_file(proxy: ProxyProcess, workspace: tuple[Path, dict[str, str]]) -> None:
    repo, env = workspace
    project = "e2e-pi"
    pi = client("pi")
    agent = Path(env["HOME"]) / ".pi" / "agent"
    agent.mkdir(parents=True)
    models = (ROOT / "examples" / "pi-models.json").read_text()
    (agent / "models.json").write_text(models.replace(EXAMPLE_BASE, f"{proxy.base}/p/{project}/v1"))
    env = {**env, "PI_OFFLINE": "1"}
    argv: list[str | Path] = [pi, "-p", "--provider", "adaptive-spec", "--model", "local"]
    made = repo / "hello.py"
    made.unlink()
    first = run([*argv, CREATE], repo, env, stop_after=1500)
    created = file_text(made)
    second = run([*argv, "-c", EDIT], repo, env, stop_after=1500)
    recs = records(proxy, project)
    notes = f"created: {created!r}; after the edit: {file_text(made)!r}\n" + (first.stdout + second.stdout)[-1500:]
    out = summary("pi", recs, 1, [first, second], notes=notes)
    _check("pi", recs, out)
    assert {r["session_source"] for r in recs if r["api"] == "chat"} == {"header:x-session-affinity"}, out


def test_continue_cli_creates_then_changes_a_file(
    proxy: ProxyProcess, workspace: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    repo, env = workspace
    project = "e2e-continue-cli"
    cn = client("cn")
    config = tmp_path / "config.yaml"
    text = (ROOT / "examples" / "continue-cli-config.yaml").read_text()
    config.write_text(text.replace(EXAMPLE_BASE, f"{proxy.base}/p/{project}/v1"))
    argv: list[str | Path] = [cn, "-p", "--auto", "--config", config]
    made = repo / "hello.py"
    made.unlink()
    first = run([*argv, CREATE], repo, env, stop_after=1500)
    created = file_text(made)
    second = run([*argv, "--resume", EDIT], repo, env, stop_after=1500)
    recs = records(proxy, project)
    notes = f"created: {created!r}; after the edit: {file_text(made)!r}\n" + (first.stdout + second.stdout)[-1500:]
    out = summary("continue-cli", recs, 1, [first, second], notes=notes)
    # A first run that fails (exit 1, as on the 1.5B once, its file written) saves no session: --resume then starts
    # a conversation of its own, which the proxy sees as such.
    _check("continue-cli", recs, out, conversations=1 if first.returncode == 0 else 2)
    # Its --resume turn writes the workspace into a new system prompt: the same tools keep it on the main line.
    assert out["side_requests"] == 0, out


def test_cline_creates_then_changes_a_file(
    proxy: ProxyProcess, workspace: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    repo, env = workspace
    project = "e2e-cline"
    cline = client("cline")
    data = tmp_path / "cline-data"
    base = f"{proxy.base}/p/{project}/v1"
    auth = run([cline, "auth", "openai", "-k", "local", "-m", "local", "-b", base, "--data-dir", data], repo, env)
    assert auth.returncode == 0, auth.stdout + auth.stderr
    # -t: the task's own limit, past a first turn's prefill on a loaded CPU (its default is none).
    argv: list[str | Path] = [cline, "--data-dir", data, "-c", repo, "-t", "1400"]
    made = repo / "hello.py"
    made.unlink()
    first = run([*argv, CREATE], repo, env, stop_after=1500)
    created = file_text(made)
    # A task is resumed only interactively (`--id` asks for a terminal in 3.0.65): the change is a task of its own,
    # in the same repository, and a conversation of its own.
    second = run([*argv, EDIT], repo, env, stop_after=1500)
    recs = records(proxy, project)
    notes = f"created: {created!r}; after the edit: {file_text(made)!r}\n"
    out = summary("cline", recs, 2, [first, second], notes=notes + (first.stdout + second.stdout)[-1500:])
    _check("cline", recs, out, conversations=2)
