"""The routing policy's values and defaults, and reading TOML policy files into them with every problem named by
file, dotted key and line. A file is an overlay: it sets any subset of keys on top of the policy before it."""

from __future__ import annotations

import difflib
import json
import math
import re
import tomllib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from adaptive_spec.errors import ConfigError


@dataclass(frozen=True, slots=True)
class _Range:
    """The valid values of a numeric key; `low_open` means strictly greater than `low`."""

    low: float
    high: float | None = None
    low_open: bool = False

    def check(self, value: float) -> str | None:
        too_low = value <= self.low if self.low_open else value < self.low
        if self.high is not None and (too_low or value > self.high):
            return f"must be between {_num(self.low)} and {_num(self.high)}, got {_num(value)}"
        if too_low:
            return f"must be {'greater than' if self.low_open else 'at least'} {_num(self.low)}, got {_num(value)}"
        return None


def _key(default: Any, doc: str, low: float | None = None, high: float | None = None, *, low_open: bool = False) -> Any:
    """One policy key, declared once: its default, what it does, and (for a number) its valid range. The checks of
    policy files are derived from these declarations (`_RANGES`, `_KINDS`); default.toml says the same in prose,
    and a test holds the two together."""
    valid = _Range(low, high, low_open) if low is not None else None
    return field(default=default, metadata={"doc": doc, "range": valid})


@dataclass(frozen=True, slots=True)
class RoutePolicy:
    """Which profiles a request may go to, and how readily a session moves between them."""

    profiles: tuple[str, ...] = _key((), "profiles the router may choose from; empty = every profile served")
    force: str | None = _key(None, 'send every request to this profile (TOML: "" means none)')
    hysteresis: float = _key(0.15, "move a session only if the other profile is estimated this much faster", 0, 1)
    min_dwell_turns: int = _key(2, "turns a session stays on a profile before it may move again", 0)
    explore: float = _key(0.0, "share of decisions sent to a not-chosen profile to learn its speed", 0, 0.5)
    max_queue: int = _key(2, "requests in flight on a profile beyond its slots before it counts as overloaded", 0)
    hold_beside_plain: int = _key(
        3, "while this many requests without speculation decode on its server, a request does not speculate (0: off)", 0
    )
    adapt_draft_length: bool = _key(
        True, "cap a sequential drafter's draft length per session, from its measured acceptance"
    )
    speculate_max_busy: int = _key(
        0, "at this many requests in flight on its server, a request runs without speculation (0: no limit)", 0
    )


@dataclass(frozen=True, slots=True)
class FirstTurnPolicy:
    """How a session's first turn, which has no history to measure, is judged copy-heavy."""

    copy_share: float = _key(0.6, "copyability assumed for a first turn that looks copy-heavy", 0, 1)
    min_lines: int = _key(20, "a pasted block at least this many lines long ...", 1)
    phrases: tuple[str, ...] = _key(
        (
            "complete updated file",
            "full updated file",
            "entire file",
            "whole file",
            "complete file",
            "full file",
            "return the updated",
            "rewrite the file",
        ),
        "... and one of these (case-insensitive)",
    )


@dataclass(frozen=True, slots=True)
class EstimatorPolicy:
    """The priors of the speed estimates, and how fast measurements replace them."""

    decode_tps: float = _key(
        40.0, "prior decode tok/s without speculation, before any request was measured", 0, low_open=True
    )
    prefill_tps: float = _key(400.0, "prior prompt-processing tok/s", 0, low_open=True)
    ngram_max_speedup: float = _key(3.0, "prior: n-gram profile's speed at copyability 1.0 over plain", 1)
    ngram_overhead: float = _key(0.03, "prior: n-gram profile's slowdown on output it cannot copy", 0, 1)
    drafter_max_speedup: float = _key(
        2.0, "prior: model-drafter profile's speed at drafter acceptance 1.0 over no speculation", 0, low_open=True
    )
    drafter_overhead: float = _key(0.1, "prior: model-drafter profile's slowdown when every draft is rejected", 0, 1)
    draft_token_cost: float = _key(
        0.3, "a drafted token's cost relative to one target decode step (sequential drafters)", 0
    )
    drafter_acceptance_code: float = _key(0.6, "prior: drafter acceptance on code before a session measured it", 0, 1)
    drafter_acceptance_prose: float = _key(0.15, "prior: drafter acceptance on prose and chat", 0, 1)
    context_slowdown_per_1k: float = _key(0.05, "prior: decode time grows this share per 1,000 context tokens", 0)
    prior_weight: float = _key(3.0, "how many measured requests the priors are worth", 0, low_open=True)
    half_life: int = _key(50, "measured requests after which an old measurement counts half", 1)
    output_tokens: int = _key(256, "expected output tokens before a session has a history", 1)
    chars_per_token: float = _key(3.5, "prompt chars per token, before measured", 0, low_open=True)


@dataclass(frozen=True, slots=True)
class HandoffPolicy:
    """Whether a session that moves takes its KV cache along, and what that is assumed to cost."""

    enabled: bool = _key(True, "save the session's KV slot on the old profile and restore it on the new one")
    with_draft_models: bool = _key(False, "also between profiles with a separate draft model (-md): see default.toml")
    min_tokens: int = _key(1024, "below this many cached tokens a re-prefill is cheaper than a slot file round trip", 0)
    save_s_per_1k: float = _key(0.04, "prior seconds to save 1,000 tokens of KV", 0)
    restore_s: float = _key(0.02, "prior seconds to restore a slot file", 0)
    min_reuse: float = _key(
        0.4,
        "a profile pair's handoffs must have reused this share of what they restored, else sessions re-prefill",
        0,
        1,
    )


@dataclass(frozen=True, slots=True)
class AgentsPolicy:
    """What the proxy does when an agent loops on one tool call (requests/body/repeats.py)."""

    repeat_note_after: int = _key(
        2, "identical tool calls in a row after which a note says the call was made already (0 = never)", 0
    )
    repeat_text_after: int = _key(
        3, "identical tool calls in a row after which the answer must be text, ending the agent's turn (0 = never)", 0
    )


@dataclass(frozen=True, slots=True)
class HeadsPolicy:
    """Warm starts (kv/heads/): whether a project's sessions keep and get agents' heads from the store."""

    enabled: bool = _key(True, "keep this project's first turns as heads and restore them into new sessions")
    min_tokens: int = _key(
        256, "a first turn of fewer prompt tokens is not kept (it prefills in well under a second)", 0
    )
    session_idle_s: float = _key(
        30.0, "seconds a session waits without a request before its state is kept (0: sessions are not kept)", 0
    )


@dataclass(frozen=True, slots=True)
class Policy:
    """The effective policy: built-in defaults with the overlays of `sources` applied in order."""

    route: RoutePolicy = field(default_factory=RoutePolicy)
    first_turn: FirstTurnPolicy = field(default_factory=FirstTurnPolicy)
    estimator: EstimatorPolicy = field(default_factory=EstimatorPolicy)
    handoff: HandoffPolicy = field(default_factory=HandoffPolicy)
    agents: AgentsPolicy = field(default_factory=AgentsPolicy)
    heads: HeadsPolicy = field(default_factory=HeadsPolicy)
    sources: tuple[str, ...] = ()  # files this policy was built from, in order (empty = built-in defaults)


TABLES: dict[str, type[Any]] = {
    "route": RoutePolicy,
    "first_turn": FirstTurnPolicy,
    "estimator": EstimatorPolicy,
    "handoff": HandoffPolicy,
    "agents": AgentsPolicy,
    "heads": HeadsPolicy,
}
Overlay = dict[str, dict[str, Any]]
# dotted key → its valid range, from the declarations
_RANGES: dict[str, _Range] = {
    f"{table}.{f.name}": f.metadata["range"]
    for table, cls in TABLES.items()
    for f in fields(cls)
    if f.metadata["range"]
}


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


def _num(value: float) -> str:
    return f"{value:g}"


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
    shown = "" if isinstance(value, list | dict) else f" {_toml_literal(value)}"[:40]
    return f"got {_toml_type(value)}{shown}"


def _did_you_mean(word: str, choices: Collection[str], what: str = "known") -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{close[0]}'?"
    return f" ({what}: {', '.join(choices)})" if choices else f" (no {what})"


# table → field name → its annotation as written (this module's annotations are strings), which picks the check
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
    if kind == "str | None":
        if not isinstance(value, str):
            return None, [f'expected a profile name, or "" for none, {_got(value)}']
        return (value or None), []
    converted, error = _check_scalar(kind, value)
    if error is None and dotted in _RANGES:
        error = _RANGES[dotted].check(converted)
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


def apply(base: Policy, overlay: Mapping[str, Mapping[str, Any]], source: str) -> Policy:
    """`base` with an overlay from `parse_overlay` applied, and `source` appended to its sources."""
    tables = {table: replace(getattr(base, table), **values) for table, values in overlay.items()}
    return replace(base, **tables, sources=(*base.sources, source))


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


def _toml_value(value: Any) -> Any:
    if value is None:
        return ""
    return list(value) if isinstance(value, tuple) else value


def policy_to_toml_dict(policy: Policy) -> dict[str, dict[str, Any]]:
    """The policy's tables as TOML would hold them (lists for tuples, "" for no forced profile); no sources."""
    return {
        table: {f.name: _toml_value(getattr(getattr(policy, table), f.name)) for f in fields(cls)}
        for table, cls in TABLES.items()
    }


def _toml_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON's string escapes are valid in TOML basic strings
    if isinstance(value, list):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    return repr(value)


def policy_to_toml(policy: Policy) -> str:
    """The effective policy as a TOML file that `parse_overlay` reads back to the same values."""
    lines = [f"# from: {', '.join(policy.sources) or 'built-in defaults'}"]
    for table, values in policy_to_toml_dict(policy).items():
        lines += ["", f"[{table}]", *(f"{key} = {_toml_literal(value)}" for key, value in values.items())]
    return "\n".join(lines) + "\n"
