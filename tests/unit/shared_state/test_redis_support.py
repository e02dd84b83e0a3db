"""The tests' rule for a machine without `redis-server`: skipped on a developer's machine, failed where
`.ci/run` says Redis must be there (ADAPTIVE_SPEC_NEEDS_REDIS), so a green CI run means the shared-state tests ran."""

from __future__ import annotations

import shutil

import pytest

from tests.support.processes import redis as support


def test_without_redis_server_a_test_skips_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("ADAPTIVE_SPEC_NEEDS_REDIS", raising=False)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install redis-server"):
        support.redis_binary()


def test_without_redis_server_a_test_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("ADAPTIVE_SPEC_NEEDS_REDIS", "1")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.fail.Exception, match="CI must have it"):
        support.redis_binary()
