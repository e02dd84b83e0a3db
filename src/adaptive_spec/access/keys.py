"""The one way a command reads a key from a flag, a file or the environment, and declares the options it reads; pure
but for the environment and the file reader it is given."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from adaptive_spec.errors import ConfigError


def _read_utf8(path: Path) -> str:
    return path.read_text(encoding="utf-8")


@dataclass(frozen=True, slots=True)
class KeyOption:
    """Where one command takes its key from: a flag (`--api-key KEY`), a file option (`--api-key-file FILE`, the key
    on its first line), either of them absent, and an environment variable.

    Precedence, the same for every command: the flag or the file (giving both is an error), else the environment.
    The file's first line is stripped and must not be empty; the environment's value is stripped, and a blank one is
    unset; the flag's value is taken as given, an empty one unset.
    """

    env: str
    flag: str | None = None
    file_flag: str | None = None

    def add_arguments(
        self,
        parser: argparse.ArgumentParser | argparse._ArgumentGroup,
        *,
        flag_help: str | None = None,
        file_help: str | None = None,
    ) -> None:
        """Declares the flag and the file option (those this key has), in that order."""
        if self.flag is not None:
            parser.add_argument(self.flag, metavar="KEY", help=flag_help)
        if self.file_flag is not None:
            parser.add_argument(self.file_flag, type=Path, metavar="FILE", help=file_help)

    def read(
        self,
        args: argparse.Namespace,
        environ: Mapping[str, str] = os.environ,
        read_text: Callable[[Path], str] = _read_utf8,
    ) -> str | None:
        """The key, by the precedence above; None: none given. Raises ConfigError naming the option at fault."""
        given: str | None = getattr(args, _dest(self.flag)) if self.flag else None
        file: Path | None = getattr(args, _dest(self.file_flag)) if self.file_flag else None
        if given and file:
            raise ConfigError(f"{self.flag} and {self.file_flag}: give one of them")
        if file:
            try:
                lines = read_text(file).splitlines()
            except OSError as exc:
                raise ConfigError(f"{self.file_flag} {file}: {exc.strerror or exc}") from exc
            key = lines[0].strip() if lines else ""
            if not key:
                raise ConfigError(f"{self.file_flag} {file}: the first line is empty")
            return key
        return given or environ.get(self.env, "").strip() or None


def _dest(flag: str) -> str:
    """The Namespace attribute argparse stores a flag under: `--api-key-file` -> `api_key_file`."""
    return flag.lstrip("-").replace("-", "_")
