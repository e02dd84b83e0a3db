from __future__ import annotations

import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from adaptive_spec.errors import ConfigError
from adaptive_spec.policy.files import default_policy_text
from adaptive_spec.policy.model import (
    TABLES,
    EstimatorPolicy,
    FirstTurnPolicy,
    Policy,
    RoutePolicy,
    apply,
    policy_to_toml,
    policy_to_toml_dict,
)
from adaptive_spec.policy.reading import PolicyError, Problem, line_of, load_policy, locate_keys, parse_overlay

REPO_POLICIES = Path(__file__).resolve().parents[3] / "policies"


def _problems(text: str, known: list[str] | None = None) -> list[str]:
    return [str(p) for p in parse_overlay(text, "a.toml", known)[1]]


# --- the shipped default.toml ---


def test_shipped_default_is_exactly_the_built_in_defaults() -> None:
    policy = load_policy([("default.toml", default_policy_text())])
    assert policy == Policy(sources=("default.toml",))


def test_shipped_default_sets_every_field_and_nothing_else() -> None:
    data = tomllib.loads(default_policy_text())
    assert set(data) == set(TABLES)
    for table, cls in TABLES.items():
        assert set(data[table]) == {f.name for f in fields(cls)}, table


def test_every_key_of_the_shipped_default_has_a_comment_above_it() -> None:
    lines = default_policy_text().split("\n")
    for key, number in locate_keys(default_policy_text()).items():
        if "." in key:
            assert lines[number - 2].startswith("#"), f"{key} (line {number}) has no comment above it"


POLICY_FILES = sorted([*REPO_POLICIES.glob("*.toml"), *(REPO_POLICIES.parent / "examples").glob("*policy*.toml")])


def test_the_repository_policy_files_are_found() -> None:
    # Guards the test below: a glob that found nothing would make it pass without loading a single file.
    assert {p.name for p in POLICY_FILES} >= {"default.toml", "project-policy.toml"}


@pytest.mark.parametrize("path", POLICY_FILES, ids=lambda p: p.name)
def test_every_policy_file_of_the_repository_loads(path: Path) -> None:
    policy = load_policy([(path.name, path.read_text(encoding="utf-8"))], known_profiles=["oneshot", "iterative"])
    assert policy.sources == (path.name,)


def test_the_repository_default_is_the_shipped_file() -> None:
    assert (REPO_POLICIES / "default.toml").read_text(encoding="utf-8") == default_policy_text()


# --- overlays ---


def test_a_file_sets_only_the_keys_it_names() -> None:
    overlay, problems = parse_overlay("[route]\nhysteresis = 0.3\n[handoff]\nenabled = false\n", "a.toml")
    assert problems == []
    policy = apply(Policy(), overlay, "a.toml")
    assert policy.route == RoutePolicy(hysteresis=0.3)
    assert policy.handoff.enabled is False and policy.handoff.min_tokens == 1024
    assert policy.estimator == EstimatorPolicy() and policy.sources == ("a.toml",)


def test_overlays_apply_in_order() -> None:
    policy = load_policy(
        [
            ("base.toml", "[route]\nhysteresis = 0.3\nexplore = 0.1\n"),
            ("project.toml", "[route]\nhysteresis = 0.4\n"),
        ]
    )
    assert (policy.route.hysteresis, policy.route.explore) == (0.4, 0.1)
    assert policy.sources == ("base.toml", "project.toml")


def test_values_are_converted_to_the_field_types() -> None:
    text = '[route]\nprofiles = ["oneshot"]\nforce = ""\nhysteresis = 1\n[first_turn]\nphrases = []\n'
    policy = load_policy([("a.toml", text)])
    assert policy.route.profiles == ("oneshot",) and policy.route.force is None
    assert policy.route.hysteresis == 1.0 and isinstance(policy.route.hysteresis, float)
    assert policy.first_turn == FirstTurnPolicy(phrases=())


def test_dotted_keys_and_inline_tables_work_as_tables() -> None:
    policy = load_policy([("a.toml", 'route.hysteresis = 0.2\nestimator = { decode_tps = 12 }\nroute.force = "x"\n')])
    assert (policy.route.hysteresis, policy.route.force, policy.estimator.decode_tps) == (0.2, "x", 12.0)


def test_a_bad_value_leaves_the_good_ones_in_the_overlay() -> None:
    overlay, problems = parse_overlay("[route]\nhysteresis = 2\nexplore = 0.2\n", "a.toml")
    assert overlay == {"route": {"explore": 0.2}} and len(problems) == 1


# --- the declarations: each key's type, default and range in one place, and the checks follow them ---


def _declared() -> list[tuple[str, str, str, Any]]:
    return [(t, f.name, str(f.type), f.metadata["range"]) for t, cls in TABLES.items() for f in fields(cls)]


def test_every_key_is_declared_with_what_it_does() -> None:
    for table, cls in TABLES.items():
        for f in fields(cls):
            assert f.metadata["doc"].strip(), f"{table}.{f.name} has no description"


@pytest.mark.parametrize(
    ("table", "key", "kind", "valid"), [d for d in _declared() if d[3] is not None], ids=lambda v: str(v)
)
def test_each_declared_range_is_the_one_files_are_checked_against(table: str, key: str, kind: str, valid: Any) -> None:
    step = 1 if kind == "int" else 0.125
    lowest = valid.low + step if valid.low_open else valid.low
    too_low = valid.low if valid.low_open else valid.low - step
    values = [lowest] + ([valid.high] if valid.high is not None else [])
    for value in values:
        assert _problems(f"[{table}]\n{key} = {value!r}\n") == [], (table, key, value)
    low_problems = _problems(f"[{table}]\n{key} = {too_low!r}\n")
    assert len(low_problems) == 1 and low_problems[0].startswith(f"a.toml:{table}.{key}:2: must be")
    if valid.high is not None:
        high_problems = _problems(f"[{table}]\n{key} = {valid.high + step!r}\n")
        assert len(high_problems) == 1 and "must be between" in high_problems[0]


def test_every_number_without_a_declared_range_is_a_boolean_or_not_a_number() -> None:
    unranged = [(t, k, kind) for t, k, kind, valid in _declared() if valid is None]
    assert all(kind not in ("int", "float") for _, _, kind in unranged), unranged


# --- problems: every one, named by file, dotted key and line ---


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[route]\nhysterisis = 0.2\n", "a.toml:route.hysterisis:2: unknown key; did you mean 'hysteresis'?"),
        ("[routes]\nx = 1\n", "a.toml:routes:1: unknown table; did you mean 'route'?"),
        ("hysteresis = 0.2\n", "a.toml:hysteresis:1: unknown key; did you mean 'route.hysteresis'?"),
        ("[route]\ndecode_tps = 3\n", "a.toml:route.decode_tps:2: unknown key; did you mean 'estimator.decode_tps'?"),
        (
            "[route]\nzzz = 1\n",
            "a.toml:route.zzz:2: unknown key (keys: profiles, force, hysteresis, min_dwell_turns, explore, max_queue, "
            "hold_beside_plain, adapt_draft_length, speculate_max_busy)",
        ),
        (
            "[zzz]\n",
            "a.toml:zzz:1: unknown table (tables: route, first_turn, estimator, handoff, agents, heads, shared_state)",
        ),
        ("route = 3\n", "a.toml:route:1: expected a table [route], got integer 3"),
        ("[route]\nhysteresis = 1.5\n", "a.toml:route.hysteresis:2: must be between 0 and 1, got 1.5"),
        ("[route]\nexplore = -0.1\n", "a.toml:route.explore:2: must be between 0 and 0.5, got -0.1"),
        ("[route]\nmax_queue = -1\n", "a.toml:route.max_queue:2: must be at least 0, got -1"),
        ("[estimator]\ndecode_tps = 0\n", "a.toml:estimator.decode_tps:2: must be greater than 0, got 0"),
        ("[estimator]\ndecode_tps = inf\n", "a.toml:estimator.decode_tps:2: expected a finite number, got float inf"),
        ("[estimator]\nngram_max_speedup = 0.5\n", "a.toml:estimator.ngram_max_speedup:2: must be at least 1, got 0.5"),
        ("[estimator]\nhalf_life = 2.5\n", "a.toml:estimator.half_life:2: expected an integer, got float 2.5"),
        ("[route]\nmin_dwell_turns = true\n", "a.toml:route.min_dwell_turns:2: expected an integer, got boolean true"),
        ('[route]\nhysteresis = "0.2"\n', 'a.toml:route.hysteresis:2: expected a number, got string "0.2"'),
        ("[route]\nhysteresis = true\n", "a.toml:route.hysteresis:2: expected a number, got boolean true"),
        ('[handoff]\nenabled = "yes"\n', 'a.toml:handoff.enabled:2: expected true or false, got string "yes"'),
        ("[route]\nforce = 1\n", 'a.toml:route.force:2: expected a profile name, or "" for none, got integer 1'),
        (
            '[route]\nprofiles = "oneshot"\n',
            'a.toml:route.profiles:2: expected an array of strings, got string "oneshot"',
        ),
        (
            '[first_turn]\nphrases = ["a", 3, ""]\n',
            "a.toml:first_turn.phrases:2: entry 2: expected a non-empty string, got integer 3",
        ),
        ('[route]\nprofiles = ["a"]\nforce = "b"\n', "a.toml:route.force:3: 'b' is not one of route.profiles (a)"),
        ("[route]\nhysteresis = \n", "a.toml:2: invalid TOML: invalid value at column 14"),
        ("[route]\nprofiles = [\n", "a.toml:3: invalid TOML: invalid value at the end of the file"),
    ],
)
def test_problem_wording(text: str, expected: str) -> None:
    assert _problems(text)[0] == expected


def test_profiles_are_checked_against_the_served_ones_when_known() -> None:
    text = '[route]\nforce = "iterativ"\nprofiles = ["oneshot", "zzz"]\n'
    assert _problems(text, ["oneshot", "iterative"]) == [
        "a.toml:route.force:2: unknown profile 'iterativ'; did you mean 'iterative'?",
        "a.toml:route.profiles:3: entry 2: unknown profile 'zzz' (profiles: iterative, oneshot)",
    ]
    assert _problems(text) == ["a.toml:route.force:2: 'iterativ' is not one of route.profiles (oneshot, zzz)"]
    assert _problems('[route]\nforce = "oneshot"\n', ["oneshot"]) == []
    assert parse_overlay(text + "hysteresis = 0.2\n", "a.toml", ["oneshot"])[0] == {"route": {"hysteresis": 0.2}}


def test_every_problem_is_reported_not_just_the_first() -> None:
    text = "[route]\nhysteresis = 3\nexplore = 1\n\n[estimator]\nhalf_life = 0\nbogus = 1\n"
    assert [p.split(": ")[0] for p in _problems(text)] == [
        "a.toml:route.hysteresis:2",
        "a.toml:route.explore:3",
        "a.toml:estimator.half_life:6",
        "a.toml:estimator.bogus:7",
    ]


def test_load_policy_raises_with_the_problems_of_all_files() -> None:
    with pytest.raises(PolicyError) as caught:
        load_policy([("a.toml", "[route]\nexplore = 1\n"), ("b.toml", "[x]\n")])
    assert str(caught.value) == (
        "a.toml:route.explore:2: must be between 0 and 0.5, got 1\nb.toml:x:1: unknown table (tables: route, "
        "first_turn, estimator, handoff, agents, heads, shared_state)"
    )
    assert [p.file for p in caught.value.problems] == ["a.toml", "b.toml"]
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, ConfigError)


def test_problem_leaves_out_what_it_does_not_know() -> None:
    assert str(Problem("a.toml", "route.force", 3, "m")) == "a.toml:route.force:3: m"
    assert str(Problem("a.toml", "", 3, "m")) == "a.toml:3: m"
    assert str(Problem("a.toml", "route.force", None, "m")) == "a.toml:route.force: m"
    assert str(Problem("a.toml", "", None, "m")) == "a.toml: m"


# --- the line locator ---


def test_locate_keys_finds_headers_plain_dotted_and_quoted_keys() -> None:
    text = (
        '# comment\nroute.hysteresis = 0.2\n[ estimator ]\n"decode_tps" = 3\n  prefill_tps=4\n'
        '[first_turn]\nphrases = """\nfake = 1\n"""\nmin_lines = 3\n[handoff]\nx = { y = 1 }\n'
    )
    lines = locate_keys(text)
    assert lines == {
        "route.hysteresis": 2,
        "estimator": 3,
        "estimator.decode_tps": 4,
        "estimator.prefill_tps": 5,
        "first_turn": 6,
        "first_turn.phrases": 7,
        "first_turn.min_lines": 10,
        "handoff": 11,
        "handoff.x": 12,
    }
    assert line_of(lines, "handoff.x.y") == 12
    assert line_of(lines, "route.explore") is None
    assert line_of(lines, "") is None


# --- showing the policy ---


def test_policy_to_toml_dict_is_what_a_file_would_hold() -> None:
    shown = policy_to_toml_dict(Policy(sources=("a.toml",)))
    assert shown == tomllib.loads(default_policy_text())


def test_policy_to_toml_reads_back_to_the_same_policy() -> None:
    policy = load_policy([("a.toml", '[route]\nforce = "it\\"s"\nprofiles = ["it\\"s"]\nhysteresis = 1e-7\n')])
    text = policy_to_toml(policy)
    assert text.startswith("# from: a.toml\n")
    assert load_policy([("a.toml", text)]) == policy


def test_the_shared_state_url_is_a_redis_url_without_a_password() -> None:
    overlay, problems = parse_overlay('[shared_state]\nurl = "redis://10.0.0.9:6379/0"\nlease_s = 5\n', "a.toml")
    assert overlay == {"shared_state": {"url": "redis://10.0.0.9:6379/0", "lease_s": 5.0}} and problems == []
    text = '[shared_state]\nttl_s = 60\nurl = "http://10.0.0.9:6379"\n'
    assert _problems(text) == [
        "a.toml:shared_state.url:3: 'http' is not a Redis URL (redis://, rediss://, unix://)",
    ]
    assert _problems('[shared_state]\nurl = "redis://:secret@10.0.0.9/0"\n') == [
        "a.toml:shared_state.url:2: holds a password, which a policy shows: give that URL with --shared-state",
    ]
    assert _problems("[shared_state]\nurl = 6379\nlease_s = 0\n") == [
        "a.toml:shared_state.url:2: expected a string, got integer 6379",
        "a.toml:shared_state.lease_s:3: must be greater than 0, got 0",
    ]
