"""The soak's agent traffic and its look at the head store (`serve`'s warm starts).

Agent sessions are the recorded request shapes of tests/data/agent-shapes/ (synthetic bodies with the structure
Claude Code, Codex CLI, Qwen Code, opencode, aider and llm send; no agent's own prompt text), each opened with one of
a few long synthetic heads (a system prompt and a tool list of a few thousand characters) in place of the shape's
short system text. A new session id each time: the proxy saves a session's first turn as a head, and a later session
that opens with the same head and shape gets it restored. The heads are drawn with a skew (a few common, several
rare) and the store's bound is small, so the rare ones push the common ones out now and then: saves, restores and
evictions all happen within minutes. Half the sessions send a second turn."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

SHAPES = Path(__file__).resolve().parents[1] / "data" / "agent-shapes"
PATHS = {"claude-code": "/v1/messages?beta=true", "codex": "/v1/responses"}  # the others: chat completions
HEAD_WEIGHTS = (8, 4, 2, 1, 1, 1)  # head k is drawn with weight HEAD_WEIGHTS[k]
HEAD_RULES = 24  # rule lines of a head (~60 characters each) before its tool list
HEAD_TOOLS = 12  # synthetic tools listed in a head's text (~70 characters each)
SECOND_TURN_SHARE = 0.5


def head_text(k: int) -> str:
    """Head k: synthetic instructions and tools, ~2,400 characters (as many tokens on the tiny model)."""
    rules = "\n".join(
        f"{i}. Rule {k}.{i}: keep module_{i} small, typed and tested; explain each edit." for i in range(HEAD_RULES)
    )
    tools = "\n".join(
        f"- tool_{k}_{i}(path: str, text: str) -> str: edits file_{i}.py as asked and returns a diff."
        for i in range(HEAD_TOOLS)
    )
    return f"You are synthetic coding agent number {k}. Follow these rules.\n{rules}\nTools:\n{tools}\n"


def load_shapes() -> list[tuple[str, dict[str, Any]]]:
    shapes = [(p.stem, json.loads(p.read_text())) for p in sorted(SHAPES.glob("*.json"))]
    if len(shapes) < 6:
        raise SystemExit(f"the agent shapes are missing from {SHAPES}")
    return shapes


def path_of(name: str) -> str:
    return next((path for agent, path in PATHS.items() if name.startswith(agent)), "/v1/chat/completions")


def _with_head(body: dict[str, Any], head: str) -> None:
    """The shape's own system text replaced by `head` (added where the shape has none)."""
    if isinstance(body.get("system"), list):  # Anthropic: the billing-header block stays first
        body["system"][-1]["text"] = head
    elif "instructions" in body:  # Responses
        body["instructions"] = head
    elif body["messages"] and body["messages"][0].get("role") == "system":
        body["messages"][0]["content"] = head
    else:
        body["messages"].insert(0, {"role": "system", "content": head})


def _second_turn(body: dict[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(body)
    if "input" in body:
        body["input"].append({"role": "user", "content": "Go on."})
    else:
        body["messages"] += [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Go on."}]
    return body


def session_turns(
    shapes: list[tuple[str, dict[str, Any]]], rng: random.Random, max_tokens: int
) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """One agent session: its label ("agent:<shape>") and its turns (path, body), the first opening with a head
    (a side request, opencode's title, keeps its own short text)."""
    name, shape = rng.choice(shapes)
    body = copy.deepcopy(shape)
    body["max_output_tokens" if "max_output_tokens" in body else "max_tokens"] = max_tokens
    if "title" not in name:
        _with_head(body, head_text(rng.choices(range(len(HEAD_WEIGHTS)), HEAD_WEIGHTS)[0]))
    turns = [(path_of(name), body)]
    if rng.random() < SECOND_TURN_SHARE:
        turns.append((path_of(name), _second_turn(body)))
    return f"agent:{name}", turns


def store_sample(heads: dict[str, Any], directory: Path) -> dict[str, Any]:
    """The store as `GET /adaptive/heads` tells it (its bytes, bound, heads, counts by outcome), and the bytes of the
    head files on disk beside it."""
    on_disk = 0
    for path in directory.glob("*.head"):
        try:
            on_disk += path.stat().st_size
        except FileNotFoundError:  # evicted between the listing and the look
            continue
    return {
        "bytes": heads.get("bytes", 0),
        "max_bytes": heads.get("max_bytes", 0),
        "heads": len(heads.get("heads", [])),
        "disk_bytes": on_disk,
        "counts": dict(heads.get("counts", {})),
    }
