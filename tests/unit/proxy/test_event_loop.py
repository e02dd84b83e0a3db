"""The proxy's event loop: Python's own by default, uvloop's when asked and installed."""

from __future__ import annotations

import asyncio
import sys

import pytest

from adaptive_spec.errors import ConfigError
from adaptive_spec.proxy.event_loop import loop_factory, loop_name


def _name_on(choice: str) -> str:
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(_running())


async def _running() -> str:
    return loop_name()


def test_each_loop_runs_as_named() -> None:
    assert _name_on("asyncio") == "asyncio"
    pytest.importorskip("uvloop")
    assert _name_on("uvloop") == "uvloop"


def test_uvloop_not_installed_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # what `import uvloop` meets where it is not installed
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        loop_factory("uvloop")
    assert loop_factory("asyncio") is None


def test_an_unknown_loop_is_refused() -> None:
    with pytest.raises(ConfigError, match="choose one of asyncio, uvloop"):
        loop_factory("trio")
