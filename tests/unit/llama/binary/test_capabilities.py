"""What a llama-server binary accepts, read from its `--help` (a fake binary here: a shell script that prints a help
text), and the launch line that follows: `--no-spec-type` before `--spec-type` when the binary lists it."""

from __future__ import annotations

import os
from pathlib import Path

from adaptive_spec.llama.binary import capabilities
from adaptive_spec.llama.binary.capabilities import Capabilities
from adaptive_spec.llama.profiles import ModelSource, ProfileSpec, ServerSettings, server_argv

# Shaped like llama-server's own help lines; the additive form as upstream's open #28391 proposes it.
STOCK_HELP = """\
--spec-type [none|draft-simple|draft-dflash|ngram-mod,...]
                                        comma-separated list of types of speculative decoding to use
"""
ADDITIVE_HELP = """\
--spec-type [none|draft-simple|draft-dflash|ngram-mod,...]
                                        add types of speculative decoding to use (default: ngram-mod)
--no-spec-type                          clear the speculative decoding types (then add with --spec-type)
"""


def _fake(folder: Path, help_text: str, name: str = "llama-server") -> Path:
    """A binary that prints `help_text` for --help and counts how often it ran."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f'#!/bin/sh\necho run >> "{folder}/runs"\ncat <<"HELP"\n{help_text}HELP\n')
    path.chmod(0o755)
    return path


def _runs(folder: Path) -> int:
    runs = folder / "runs"
    return len(runs.read_text().splitlines()) if runs.exists() else 0


def test_the_flag_is_found_in_the_help_text_and_not_in_a_longer_name() -> None:
    assert Capabilities.from_help(ADDITIVE_HELP).no_spec_type
    assert not Capabilities.from_help(STOCK_HELP).no_spec_type
    assert not Capabilities.from_help("--no-spec-type-default  something else\n").no_spec_type


def test_a_binary_is_probed_once_per_path_and_modification_time(tmp_path: Path) -> None:
    binary = _fake(tmp_path / "a", ADDITIVE_HELP)
    assert capabilities.of_binary(str(binary)).no_spec_type
    assert capabilities.of_binary(str(binary)).no_spec_type
    assert _runs(tmp_path / "a") == 1
    # Rebuilt in place (another help text, a later mtime): probed again.
    _fake(tmp_path / "a", STOCK_HELP)
    st = binary.stat()
    os.utime(binary, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert not capabilities.of_binary(str(binary)).no_spec_type
    assert _runs(tmp_path / "a") == 2


def test_a_missing_or_failing_binary_offers_nothing_new(tmp_path: Path) -> None:
    assert capabilities.of_binary(str(tmp_path / "nothing-here")) == capabilities.STOCK
    broken = tmp_path / "broken"
    broken.write_text("not a program\n")
    broken.chmod(0o755)
    assert capabilities.of_binary(str(broken)) == capabilities.STOCK


def _launch_line(binary: Path, spec: ProfileSpec) -> list[str]:
    settings = ServerSettings(model=ModelSource(path="/m/t.gguf"), draft=ModelSource(path="/m/d.gguf"), threads=1)
    return server_argv(str(binary), spec, settings, host="127.0.0.1", port=9000, slot_save_path="/s")


def _spec_args(argv: list[str]) -> list[str]:
    return [a for i, a in enumerate(argv) if "spec-type" in a or (i and argv[i - 1] == "--spec-type")]


def test_where_the_binary_lists_no_spec_type_each_profile_clears_the_default_set_first(tmp_path: Path) -> None:
    binary = _fake(tmp_path / "additive", ADDITIVE_HELP)
    assert _spec_args(_launch_line(binary, ProfileSpec("plain", ("none",)))) == ["--no-spec-type"]
    drafter = _launch_line(binary, ProfileSpec("oneshot", ("draft-simple",)))
    assert _spec_args(drafter) == ["--no-spec-type", "--spec-type", "draft-simple"]
    both = _launch_line(binary, ProfileSpec("iterative", ("draft-simple", "ngram-mod")))
    assert _spec_args(both) == ["--no-spec-type", "--spec-type", "draft-simple,ngram-mod"]


def test_where_it_does_not_the_launch_line_is_as_before(tmp_path: Path) -> None:
    binary = _fake(tmp_path / "stock", STOCK_HELP)
    assert _spec_args(_launch_line(binary, ProfileSpec("plain", ("none",)))) == ["--spec-type", "none"]
    drafter = _launch_line(binary, ProfileSpec("oneshot", ("draft-simple",)))
    assert _spec_args(drafter) == ["--spec-type", "draft-simple"]
