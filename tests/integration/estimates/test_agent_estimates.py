"""The proxy's estimate of what a follow-up turn makes llama-server prefill (`new_tokens_est`) against llama-server's
own `prompt_n`, on the real Qwen2.5-Coder-0.5B behind `adaptive-spec serve` (the tiny model's template renders no
tools, so only a real one says how far off an estimate is): Claude Code's turns, whose billing line changes its value
every request, and Qwen Code's, which name no session, with its background request after each turn."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.agent_sessions import claude_code, poster, qwen_code
from tests.support.processes.servers import ProxyProcess

ESTIMATE_ERROR = 0.15  # of prompt_n, on a turn that continues its session's cached prefix


@pytest.fixture(scope="module")
def embedded(qwen_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    state = tmp_path_factory.mktemp("state")
    proxy = ProxyProcess("--threads", "1", "--ctx-size", "8192", env={"ADAPTIVE_SPEC_STATE_DIR": str(state)})
    yield proxy
    proxy.stop()


def _off(records: list[dict[str, Any]], error: float = ESTIMATE_ERROR) -> list[tuple[int, int]]:
    return [
        (r["new_tokens_est"], r["timings"]["prompt_n"])
        for r in records
        if abs(r["new_tokens_est"] - r["timings"]["prompt_n"]) > error * r["timings"]["prompt_n"]
    ]


# The first follow-up has only the first prompt's characters per token to go on (prose and tool schemas); a tool
# result of code is denser. From the second on, the session's own ratio of prefilled to estimated tokens is learned.
FIRST_FOLLOW_UP_ERROR = 0.4


def test_claude_codes_follow_up_turns_are_estimated_within_15_percent(embedded: ProxyProcess) -> None:
    records = [sent.record for sent in claude_code(poster(embedded, timeout_s=600), "cc-estimates")]
    assert {r["session_id"] for r in records} == {"cc-estimates"} and not any(r["side"] for r in records)
    follow_ups = records[1:]
    assert all(r["timings"]["cache_n"] >= records[0]["timings"]["prompt_n"] - 8 for r in follow_ups), records
    estimates = [(r["new_tokens_est"], r["timings"]["prompt_n"]) for r in follow_ups]
    assert _off(follow_ups[:1], FIRST_FOLLOW_UP_ERROR) == [], estimates
    assert _off(follow_ups[1:]) == [], estimates


def test_qwen_codes_follow_up_turns_are_estimated_within_15_percent(embedded: ProxyProcess) -> None:
    """No session header: the reply echo groups the turns; the background request after each turn (another system
    prompt, 6 of the 14 tools) is a side request and does not count as a turn."""
    sent = qwen_code(poster(embedded, timeout_s=600))
    records = [s.record for s in sent if not s.aside]
    sides = [s.record for s in sent if s.aside]
    assert len({r["session_id"] for r in records + sides}) == 1, [
        (r["session_id"], r["session_source"]) for r in records
    ]
    assert [r["side"] for r in sides] == [True, True] and not any(r["side"] for r in records)
    follow_ups = records[1:]
    estimates = [(r["new_tokens_est"], r["timings"]["prompt_n"], r["timings"]["cache_n"]) for r in follow_ups]
    assert _off(follow_ups[:1], FIRST_FOLLOW_UP_ERROR) == [], estimates
    assert _off(follow_ups[1:]) == [], estimates
