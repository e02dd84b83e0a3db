"""Real coding agents driven through `adaptive-spec serve` (opt-in: ADAPTIVE_SPEC_E2E=1).

The agents are installed by `tests/e2e/install_clients.sh` into `.e2e-clients/` (or ADAPTIVE_SPEC_E2E_CLIENTS): a test
whose client is missing is skipped with the reason. Each runs in a scratch git repository under a temporary HOME,
through `/p/<project>/v1`, against the embedded Qwen2.5-Coder-1.5B where it is installed (the `test` extras install it;
the model agents should use), else the 0.5B; ADAPTIVE_SPEC_E2E_MODEL names another (two profiles: oneshot and
iterative); ADAPTIVE_SPEC_E2E_THREADS its llama-server's threads (2). Each test writes what it saw (requests, APIs,
sessions, projects, profiles and reasons, drafted/accepted, estimated vs measured new prompt tokens) to
ADAPTIVE_SPEC_E2E_OUT (default: a temporary folder) as `<agent>.json`.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes.agents import ENABLED, e2e_model
from tests.support.processes.servers import ProxyProcess

_OPT_IN = pytest.mark.skip(reason="end-to-end agent tests are opt-in: ADAPTIVE_SPEC_E2E=1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here: skipped unless opted in, and given an hour (an agent's first turn on 2 cores takes minutes)."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.timeout(3600))
            if not ENABLED:
                item.add_marker(_OPT_IN)


@pytest.fixture(scope="session")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    state = tmp_path_factory.mktemp("state")
    trace = state / "trace.jsonl"
    # Two threads: an agent's first turn prefills ~7,000 tokens (the 1.5B: minutes even so on 2 cores).
    # ADAPTIVE_SPEC_E2E_THREADS=1 where the cores are shared (2 threads beside another busy process: decode collapses).
    threads = os.environ.get("ADAPTIVE_SPEC_E2E_THREADS") or "2"
    proc = ProxyProcess(
        *(
            "--model",
            e2e_model(),
            "--threads",
            threads,
            "--ctx-size",
            "32768",
            "--trace",
            str(trace),
            "--trace-content",
        ),
        env={"ADAPTIVE_SPEC_STATE_DIR": str(state)},
    )
    proc.trace = trace  # type: ignore[attr-defined]
    yield proc
    proc.stop()


@pytest.fixture
def workspace(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A scratch git repository with one file, and an environment with a HOME of its own and no network helpers."""
    home = tmp_path / "home"
    repo = tmp_path / "repo"
    home.mkdir()
    repo.mkdir()
    (repo / "hello.py").write_text('def greet(name):\n    return "Hello, " + name\n\n\nprint(greet("world"))\n')
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "GIT_AUTHOR_NAME": "e2e",
        "GIT_AUTHOR_EMAIL": "e2e@example.invalid",
        "GIT_COMMITTER_NAME": "e2e",
        "GIT_COMMITTER_EMAIL": "e2e@example.invalid",
    }
    for argv in (["git", "init", "-q"], ["git", "add", "."], ["git", "commit", "-qm", "start"]):
        subprocess.run(argv, cwd=repo, env=env, check=True)
    return repo, env
