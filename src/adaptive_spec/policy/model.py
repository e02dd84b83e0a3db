"""The routing policy's values and defaults, each key's valid range, and the policy written back as TOML.

A policy file is an overlay: it sets any subset of keys on top of the policy before it (`apply`); reading one, with
every problem named by file, dotted key and line, is `policy/reading.py`'s."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any


def _num(value: float) -> str:
    return f"{value:g}"


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
    policy files (`policy/reading.py`) are derived from these declarations; default.toml says the same in prose, and
    a test holds the two together."""
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
    prefill_slowdown_per_1k: float = _key(
        0.3, "prior: a prompt token's prefill time grows this share per 1,000 tokens before it", 0
    )
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
    share_gb: float = _key(0.0, "with project keys: this project's share of the heads' bound in GiB (0: equal)", 0)


REDIS_SCHEMES = ("redis", "rediss", "unix")  # the URLs the shared state takes


@dataclass(frozen=True, slots=True)
class SharedStatePolicy:
    """Several `serve` processes sharing sessions, placements, slot bookings and heads through one Redis: read from
    the proxy's own policy (`--policy`, else the shipped one) once, at start; `--shared-state` stands over it, and a
    project's or workspace's file does not change it."""

    url: str = _key("", 'the Redis URL, without a password ("": this process alone)')
    lease_s: float = _key(15.0, "seconds a slot booking outlives a proxy that stopped renewing it", 0, low_open=True)
    ttl_s: float = _key(
        3600.0, "seconds a session's placement and echoes are kept after its last turn", 0, low_open=True
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
    shared_state: SharedStatePolicy = field(default_factory=SharedStatePolicy)
    sources: tuple[str, ...] = ()  # files this policy was built from, in order (empty = built-in defaults)


TABLES: dict[str, type[Any]] = {
    "route": RoutePolicy,
    "first_turn": FirstTurnPolicy,
    "estimator": EstimatorPolicy,
    "handoff": HandoffPolicy,
    "agents": AgentsPolicy,
    "heads": HeadsPolicy,
    "shared_state": SharedStatePolicy,
}
Overlay = dict[str, dict[str, Any]]
# dotted key → its valid range, from the declarations
RANGES: dict[str, _Range] = {
    f"{table}.{f.name}": f.metadata["range"]
    for table, cls in TABLES.items()
    for f in fields(cls)
    if f.metadata["range"]
}


def apply(base: Policy, overlay: Mapping[str, Mapping[str, Any]], source: str) -> Policy:
    """`base` with an overlay from `parse_overlay` applied, and `source` appended to its sources."""
    tables = {table: replace(getattr(base, table), **values) for table, values in overlay.items()}
    return replace(base, **tables, sources=(*base.sources, source))


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


def toml_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON's string escapes are valid in TOML basic strings
    if isinstance(value, list):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    return repr(value)


def policy_to_toml(policy: Policy) -> str:
    """The effective policy as a TOML file that `parse_overlay` reads back to the same values."""
    lines = [f"# from: {', '.join(policy.sources) or 'built-in defaults'}"]
    for table, values in policy_to_toml_dict(policy).items():
        lines += ["", f"[{table}]", *(f"{key} = {toml_literal(value)}" for key, value in values.items())]
    return "\n".join(lines) + "\n"
