"""Reading TOML policy files into overlays of the policy (`policy/model.py`), with every problem named by file,
dotted key and line: all of a file's problems at once, each with a close key or profile when there is one."""

from __future__ import annotations

import difflib
import math
import re
import tomllib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlsplit

from adaptive_spec.errors import ConfigError
from adaptive_spec.policy.model import RANGES, REDIS_SCHEMES, TABLES, Overlay, Policy, apply, toml_literal


@dataclass(frozen=True)
class Problem:
    """One thing wrong in a policy file, in the `file:key:line: message` shape editors and people can jump to."""

    file: str
    key: str  # dotted, e.g. "route.hysteresis"; "" for the file as a whole
    line: int | None
    message: str

    def __str__(self) -> str:
        where = ":".join(part for part in (self.file, self.key, str(self.line or "")) if part)
        return f"{where}: {self.message}"


class PolicyError(ConfigError, ValueError):
    """One or more policy files are invalid; `problems` lists every problem of every file."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


def _toml_type(value: object) -> str:
    names: tuple[tuple[type, str], ...] = (
        (bool, "boolean"),
        (int, "integer"),
        (float, "float"),
        (str, "string"),
        (list, "array"),
        (dict, "table"),
    )
    return next((name for kind, name in names if isinstance(value, kind)), "date-time")


def _got(value: object) -> str:
    shown = "" if isinstance(value, list | dict) else f" {toml_literal(value)}"[:40]
    return f"got {_toml_type(value)}{shown}"


def _did_you_mean(word: str, choices: Collection[str], what: str = "known") -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{close[0]}'?"
    return f" ({what}: {', '.join(choices)})" if choices else f" (no {what})"


# table → field name → its annotation as written (policy/model.py's annotations are strings), which picks the check
_KINDS: dict[str, dict[str, str]] = {table: {f.name: str(f.type) for f in fields(cls)} for table, cls in TABLES.items()}


def _check_scalar(kind: str, value: Any) -> tuple[Any, str | None]:
    """The value converted to the field's type, or why it cannot be."""
    if kind not in ("bool", "int", "float"):  # a new field of a new type needs its check here
        raise TypeError(f"no check for a policy field of type {kind}")
    if kind == "bool":
        return (value, None) if isinstance(value, bool) else (None, f"expected true or false, {_got(value)}")
    if isinstance(value, bool) or (kind == "int" and not isinstance(value, int)):
        return None, f"expected {'an integer' if kind == 'int' else 'a number'}, {_got(value)}"
    if kind == "float" and not isinstance(value, int | float):
        return None, f"expected a number, {_got(value)}"
    if kind == "float" and not math.isfinite(value):
        return None, f"expected a finite number, {_got(value)}"
    return (float(value) if kind == "float" else value), None


def _check_strings(value: Any) -> tuple[tuple[str, ...] | None, list[str]]:
    if not isinstance(value, list):
        return None, [f"expected an array of strings, {_got(value)}"]
    errors = [
        f"entry {i}: expected a non-empty string, {_got(item)}"
        for i, item in enumerate(value, 1)
        if not isinstance(item, str) or not item
    ]
    return (None, errors) if errors else (tuple(value), [])


def _check_value(dotted: str, kind: str, value: Any) -> tuple[Any, list[str]]:
    """(converted value, problems) for one key; the value is None when there are problems."""
    if kind == "tuple[str, ...]":
        return _check_strings(value)
    if kind == "str":
        return (value, []) if isinstance(value, str) else (None, [f"expected a string, {_got(value)}"])
    if kind == "str | None":
        if not isinstance(value, str):
            return None, [f'expected a profile name, or "" for none, {_got(value)}']
        return (value or None), []
    converted, error = _check_scalar(kind, value)
    if error is None and dotted in RANGES:
        error = RANGES[dotted].check(converted)
    return (None, [error]) if error else (converted, [])


_Report = Callable[[str, str], None]  # (dotted key, message)


def _parse_table(table: str, values: Mapping[str, Any], report: _Report) -> dict[str, Any]:
    kinds = _KINDS[table]
    parsed: dict[str, Any] = {}
    for key, value in values.items():
        dotted = f"{table}.{key}"
        if key not in kinds:
            report(dotted, "unknown key" + _suggest_key(key, table))
            continue
        converted, errors = _check_value(dotted, kinds[key], value)
        for error in errors:
            report(dotted, error)
        if not errors:
            parsed[key] = converted
    return parsed


def _suggest_key(key: str, table: str | None) -> str:
    """A close key of `table`, else the same key in another table ("route.hysteresis" written at the top level)."""
    choices = list(_KINDS[table]) if table else list(TABLES)
    close = difflib.get_close_matches(key, choices, n=1, cutoff=0.6)
    elsewhere = [f"{t}.{key}" for t in TABLES if t != table and key in _KINDS[t]]
    if elsewhere and not close:
        return f"; did you mean '{elsewhere[0]}'?"
    return _did_you_mean(key, choices, "keys" if table else "tables")


def _check_profiles(route: dict[str, Any], known: Collection[str] | None, report: _Report) -> None:
    """Profile names must be served (when the served ones are known), and a forced profile must be among `profiles`;
    a key that fails is taken out of the overlay like any other invalid key."""
    names = sorted(known) if known is not None else None
    for i, name in enumerate(route.get("profiles", ()), 1):
        if names is not None and name not in names:
            report("route.profiles", f"entry {i}: unknown profile '{name}'" + _did_you_mean(name, names, "profiles"))
            route.pop("profiles", None)
    force, allowed = route.get("force"), route.get("profiles")
    if force and names is not None and force not in names:
        report("route.force", f"unknown profile '{force}'" + _did_you_mean(force, names, "profiles"))
        del route["force"]
    elif force and allowed and force not in allowed:
        report("route.force", f"'{force}' is not one of route.profiles ({', '.join(allowed)})")
        del route["force"]


def _check_redis_url(shared: dict[str, Any], report: _Report) -> None:
    """A Redis URL of a scheme the shared state takes, and no password: a policy is shown (`policy show`,
    /adaptive/route), so a password goes in `--shared-state` instead."""
    url = shared.get("url")
    if not url:
        return
    parts = urlsplit(url)
    if parts.scheme not in REDIS_SCHEMES:
        schemes = ", ".join(s + "://" for s in REDIS_SCHEMES)
        report("shared_state.url", f"{parts.scheme or 'no scheme'!r} is not a Redis URL ({schemes})")
        del shared["url"]
    elif parts.password is not None:
        report("shared_state.url", "holds a password, which a policy shows: give that URL with --shared-state")
        del shared["url"]


def parse_overlay(
    text: str, source: str, known_profiles: Collection[str] | None = None
) -> tuple[Overlay, list[Problem]]:
    """The valid keys of one policy file and every problem in it (all of them, not just the first).

    `known_profiles`, when given, are the profiles served: `route.force` and `route.profiles` must name them."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        return {}, [_syntax_problem(source, text, exc)]
    lines = locate_keys(text)
    problems: list[Problem] = []

    def report(key: str, message: str) -> None:
        problems.append(Problem(source, key, line_of(lines, key), message))

    overlay: Overlay = {}
    for table, values in data.items():
        if table not in TABLES:
            kind = "unknown table" if isinstance(values, dict) else "unknown key"
            report(table, kind + _suggest_key(table, None))
        elif not isinstance(values, dict):
            report(table, f"expected a table [{table}], {_got(values)}")
        else:
            parsed = _parse_table(table, values, report)
            if table == "route":
                _check_profiles(parsed, known_profiles, report)
            if table == "shared_state":
                _check_redis_url(parsed, report)
            if parsed:
                overlay[table] = parsed
    problems.sort(key=lambda p: p.line or 0)
    return overlay, problems


_POSITION = re.compile(r"\s*\(at (?:line (\d+), column (\d+)|end of document)\)\s*$")


def _syntax_problem(source: str, text: str, exc: tomllib.TOMLDecodeError) -> Problem:
    """tomllib puts the position in its message only; move it to the line field."""
    message = str(exc)
    found = _POSITION.search(message)
    line: int | None = None
    if found:
        message = message[: found.start()]
        line = int(found.group(1)) if found.group(1) else text.count("\n") + 1
        message += f" at column {found.group(2)}" if found.group(2) else " at the end of the file"
    return Problem(source, "", line, f"invalid TOML: {message[:1].lower()}{message[1:]}")


_KEY_PART = r"""(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*')"""
_KEY_PATH = rf"{_KEY_PART}(?:\s*\.\s*{_KEY_PART})*"
_HEADER = re.compile(rf"^\s*\[\[?\s*({_KEY_PATH})\s*\]")
_ASSIGN = re.compile(rf"^\s*({_KEY_PATH})\s*=")


def _dotted(path: str) -> str:
    return ".".join(part.strip("\"'") for part in re.findall(_KEY_PART, path))


def locate_keys(text: str) -> dict[str, int]:
    """Dotted key → the line (1-based) that sets it, from `[table]` headers and `key =` lines, since tomllib keeps
    no positions. Lines inside multi-line strings are skipped; a key set twice keeps its first line."""
    found: dict[str, int] = {}
    table = ""
    open_quote: str | None = None
    for number, line in enumerate(text.split("\n"), 1):
        if open_quote is not None:
            if line.count(open_quote) % 2:
                open_quote = None
            continue
        header = _HEADER.match(line)
        assign = None if header else _ASSIGN.match(line)
        if header:
            table = _dotted(header.group(1))
            found.setdefault(table, number)
        elif assign:
            key = _dotted(assign.group(1))
            found.setdefault(f"{table}.{key}" if table else key, number)
        open_quote = next((q for q in ('"""', "'''") if line.count(q) % 2), None)
    return found


def line_of(lines: Mapping[str, int], key: str) -> int | None:
    """The line of a dotted key, else of the nearest enclosing table or inline table that was found."""
    while key:
        if key in lines:
            return lines[key]
        key = key.rpartition(".")[0]
    return None


def load_policy(texts: Sequence[tuple[str, str]], known_profiles: Collection[str] | None = None) -> Policy:
    """Built-in defaults with each (source, text) applied in order; PolicyError lists the problems of all files."""
    policy = Policy()
    problems: list[Problem] = []
    for source, text in texts:
        overlay, found = parse_overlay(text, source, known_profiles)
        problems.extend(found)
        policy = apply(policy, overlay, source)
    if problems:
        raise PolicyError(problems)
    return policy
