from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from adaptive_spec.errors import AdaptiveSpecError
from tests.support.models.tiny_gguf import write_tiny_gguf
from tests.support.processes.outside import missing
from tests.support.processes.redis import RedisServer
from tests.support.processes.servers import LlamaServer


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test by what it needs, read from its fixtures (so a marker cannot be forgotten): `llama` for a real
    llama-server, `qwen` for the real Qwen model as well. `pytest -m "not qwen"` is the quick loop."""
    for item in items:
        needs = set(getattr(item, "fixturenames", ()))
        if needs & {"qwen_gguf", "qwen15_gguf", "gemma_gguf"}:
            item.add_marker(pytest.mark.qwen)
        if needs & {"llama_server_binary", "qwen_gguf", "qwen15_gguf", "gemma_gguf"}:
            item.add_marker(pytest.mark.llama)


_missing = missing  # the one rule: skip here, fail in CI


@pytest.fixture(scope="session")
def llama_server_binary() -> str:
    from adaptive_spec.llama.binary.which import find_llama_server

    try:
        return find_llama_server(None)
    except AdaptiveSpecError as exc:
        _missing(str(exc))
        raise


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server of the test's own (skipped here without one, failed in CI)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("models") / "tiny-random-llama.gguf")


def _embedded(name: str) -> Path:
    """An embedded model, assembled on first use (skipped here when its packages are missing, failed in CI)."""
    from adaptive_spec.llama.models import ensure_embedded

    try:
        return ensure_embedded(name)
    except AdaptiveSpecError as exc:
        _missing(str(exc))
        raise


@pytest.fixture(scope="session")
def qwen_gguf() -> Path:
    return _embedded("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def qwen15_gguf() -> Path:
    """The real Qwen2.5-Coder-1.5B: with the 0.5B as its draft model, the real model-drafter pair on this CPU."""
    return _embedded("qwen2.5-coder-1.5b")


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """The real Gemma 3 270M (a base model): sliding-window attention, the SWA target of the warm-start tests."""
    return _embedded("gemma3-270m")


@pytest.fixture(scope="module")
def tiny_server(
    llama_server_binary: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """One real llama-server per test module, the tiny model, one slot, no drafting. It has a slot directory (as the
    profiles `serve` launches do): slot actions, such as the proxy's erase in test_security.py, need one; nothing is
    written there unless a slot is saved."""
    home = tmp_path_factory.mktemp("tiny-server")
    server = LlamaServer(
        llama_server_binary,
        tiny_gguf,
        "-c",
        "32768",
        "--parallel",
        "1",
        "--metrics",
        "--spec-type",
        "none",
        "--slot-save-path",
        str(home),
        log_dir=home,
    )
    yield server
    server.stop()
