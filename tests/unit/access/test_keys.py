"""The one key reader: its precedence (flag or file, else the environment), its errors, and every command's key
options wired to it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from adaptive_spec.access.keys import KeyOption
from adaptive_spec.access.options import API_KEY
from adaptive_spec.cli import main as cli
from adaptive_spec.cli.relay import RELAY_KEY as KV_RELAY_KEY
from adaptive_spec.cli.tui import PROXY_KEY
from adaptive_spec.errors import ConfigError
from adaptive_spec.kv.movers_options import RELAY_KEY
from adaptive_spec.kv.remote_prefill.options import PP_KEY

KEY = KeyOption("TEST_KEY", flag="--key", file_flag="--key-file")
FILES = {Path("k"): "from-file\nignored\n", Path("padded"): "  from-file \n", Path("blank"): " \n", Path("empty"): ""}


def _read(path: Path) -> str:
    if path not in FILES:
        raise FileNotFoundError(2, "No such file or directory", str(path))
    return FILES[path]


def _args(key: str | None = None, key_file: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(key=key, key_file=Path(key_file) if key_file else None)


@pytest.mark.parametrize(
    ("flag", "file", "env", "expected"),
    [
        (None, None, None, None),
        (None, None, "from-env", "from-env"),
        (None, None, " from-env\n", "from-env"),  # the environment's value is stripped
        (None, None, "  ", None),  # a blank one is unset
        ("from-flag", None, "from-env", "from-flag"),  # the flag beats the environment
        (" from-flag ", None, None, " from-flag "),  # taken as given
        ("", None, "from-env", "from-env"),  # an empty flag is unset
        (None, "k", "from-env", "from-file"),  # the file beats the environment; its first line only
        (None, "padded", None, "from-file"),  # stripped
    ],
)
def test_the_flag_or_the_file_else_the_environment(
    flag: str | None, file: str | None, env: str | None, expected: str | None
) -> None:
    environ = {"TEST_KEY": env} if env is not None else {}
    assert KEY.read(_args(flag, file), environ, _read) == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (_args("k", "k"), "--key and --key-file: give one of them"),
        (_args(key_file="blank"), "--key-file blank: the first line is empty"),
        (_args(key_file="empty"), "--key-file empty: the first line is empty"),
        (_args(key_file="missing"), "--key-file missing: No such file or directory"),
    ],
)
def test_errors_name_the_option(args: argparse.Namespace, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        KEY.read(args, {"TEST_KEY": "from-env"}, _read)  # a bad file never falls back to the environment
    assert str(caught.value) == message


def test_a_key_without_a_flag_reads_no_flag() -> None:
    file_only = KeyOption("TEST_KEY", file_flag="--key-file")
    assert file_only.read(argparse.Namespace(key_file=None), {"TEST_KEY": "e"}, _read) == "e"
    assert file_only.read(argparse.Namespace(key_file=Path("k")), {}, _read) == "from-file"


def test_the_declared_options_are_the_ones_read(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    KEY.add_arguments(parser, flag_help="the key", file_help="its file")
    key_file = tmp_path / "key"
    key_file.write_text("on-disk\n", encoding="utf-8")
    assert KEY.read(parser.parse_args(["--key-file", str(key_file)]), {}) == "on-disk"  # the real file reader
    assert KEY.read(parser.parse_args(["--key", "typed"]), {}) == "typed"
    assert [a.metavar for a in parser._actions[1:]] == ["KEY", "FILE"]


@pytest.mark.parametrize(
    ("option", "env", "argv"),
    [
        (API_KEY, "ADAPTIVE_SPEC_API_KEY", ["serve", "--api-key-file", "{file}"]),
        (API_KEY, "ADAPTIVE_SPEC_API_KEY", ["serve", "--api-key", "from-file"]),
        (PROXY_KEY, "ADAPTIVE_SPEC_API_KEY", ["tui", "--api-key", "from-file"]),
        (
            KV_RELAY_KEY,
            "ADAPTIVE_SPEC_RELAY_KEY",
            ["kv-relay", "--slot-dir", "d", "--model", "m", "--key-file", "{file}"],
        ),
        (
            KV_RELAY_KEY,
            "ADAPTIVE_SPEC_RELAY_KEY",
            ["kv-relay", "--slot-dir", "d", "--model", "m", "--key", "from-file"],
        ),
        (RELAY_KEY, "ADAPTIVE_SPEC_RELAY_KEY", ["serve", "--relay-key-file", "{file}"]),
        (PP_KEY, "ADAPTIVE_SPEC_PP_KEY", ["serve", "--pp-key-file", "{file}"]),
    ],
)
def test_every_command_reads_its_key_the_same_way(option: KeyOption, env: str, argv: list[str], tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n", encoding="utf-8")
    assert option.env == env
    given = cli._parser().parse_args([a.replace("{file}", str(key_file)) for a in argv])
    assert option.read(given, {env: "from-env"}) == "from-file"
    nothing = cli._parser().parse_args(argv[:-2])  # the same command without its key option
    assert option.read(nothing, {env: " from-env "}) == "from-env"
    assert option.read(nothing, {}) is None


def test_kv_relay_says_which_key_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("ADAPTIVE_SPEC_RELAY_KEY", raising=False)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    empty = tmp_path / "empty.key"
    empty.write_text("\n", encoding="utf-8")
    argv = ["kv-relay", "--slot-dir", str(tmp_path), "--model", str(model)]
    assert cli.main(argv) == 2
    assert "kv-relay needs a key: --key-file FILE, $ADAPTIVE_SPEC_RELAY_KEY or --key KEY" in capsys.readouterr().err
    assert cli.main([*argv, "--key-file", str(empty)]) == 2
    assert f"--key-file {empty}: the first line is empty" in capsys.readouterr().err
