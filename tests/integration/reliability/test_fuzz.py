"""A quick run of the bad-input generator (tests/stress/fuzz.py) against a real proxy and llama-server: no 5xx for
bad input, no traceback in the log, nothing leaked, no other host contacted, and the model still answers the same."""

from __future__ import annotations

from tests.stress.fuzz import run_fuzz
from tests.support.processes.servers import LlamaServer


def test_generated_bad_input(tiny_server: LlamaServer) -> None:
    figures = run_fuzz(tiny_server.url, count=200, seed=7)
    assert sum(figures.statuses.values()) == 200
    assert figures.bad_5xx == []
    assert figures.valid_not_2xx == []
    assert figures.tracebacks == 0
    assert figures.canary_connections == 0
    assert figures.fds_after <= figures.fds_before, figures.to_json()
    assert figures.tasks_after <= figures.tasks_before, figures.to_json()
    assert figures.model_answers_same
