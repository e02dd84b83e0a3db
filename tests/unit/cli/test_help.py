"""What `--help` tells a user: for the program and every command, what it does for them and how to call it."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from adaptive_spec.cli import main as cli


def _commands() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every parser of the command line by its words: (), ("serve",), ("policy", "check"), ..."""
    found: dict[tuple[str, ...], argparse.ArgumentParser] = {}

    def walk(words: tuple[str, ...], parser: argparse.ArgumentParser) -> None:
        found[words] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk((*words, name), sub)

    walk((), cli._parser())
    return found


COMMANDS = _commands()


def _docstrings() -> list[str]:
    """The docstrings of the package's loaded modules (the command line's own among them): notes for maintainers,
    which help must not show."""
    docs = [m.__doc__ or "" for name, m in sorted(sys.modules.items()) if name.split(".")[0] == "adaptive_spec"]
    assert cli.__doc__ in docs
    return [" ".join(d.split()) for d in docs if d.strip()]


def _help(words: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        cli.main([*words, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_every_command_is_checked() -> None:
    assert {(), ("serve",), ("bench",), ("report",), ("model",), ("policy",), ("policy", "check")} <= set(COMMANDS)


@pytest.mark.parametrize("words", list(COMMANDS), ids=lambda w: " ".join(w) or "adaptive-spec")
def test_help_says_what_the_command_does_with_an_example(
    words: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    parser = COMMANDS[words]
    assert parser.description, "a description of what the command does for the user"
    text = _help(words, capsys)
    flat = " ".join(text.split())
    assert " ".join(parser.description.split()) in flat
    examples = text.split("\nexamples:\n", 1)
    assert len(examples) == 2, "an examples: section"
    command = " ".join(("adaptive-spec", *words))
    lines = [line.strip() for line in examples[1].splitlines()]
    assert any(line.startswith(command) for line in lines), f"an example that runs {command!r}"
    for doc in _docstrings():
        assert doc not in flat, "a module docstring shown as help"


def test_example_lines_keep_their_columns(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(("serve",), capsys)
    assert "\n  adaptive-spec serve --model M.gguf --draft D.gguf --draft-type dflash\n" in text


def test_the_installed_command_describes_the_product() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "adaptive_spec", "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.startswith("usage: adaptive-spec")
    assert "OpenAI-compatible proxy" in done.stdout and "adaptive-spec serve" in done.stdout
    assert "exit codes" not in done.stdout, "a maintainer's note in the user's help"
