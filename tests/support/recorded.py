"""llama-server's own answers, recorded once from a real server (tests/data/llama-server/README.md says how and from
which build): the tests that need them read these, never dicts made up to look like them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RECORDED = Path(__file__).resolve().parents[1] / "data" / "llama-server"


def recorded(name: str) -> Any:
    """The recorded answer `name` (tests/data/llama-server/NAME.json), parsed afresh: callers may change it."""
    return json.loads((RECORDED / f"{name}.json").read_text())


# The keys the shipped patches (src/adaptive_spec/llama/binary/patches/) add to llama-server's answers, at any depth,
# with the patch that adds each: a stock server answers what the patched one does less these.
PATCH_KEYS = {
    "speculative_per_request": "0002-server-per-request-speculation",  # /props: what a request may choose
    "speculative.n_max": "0002-server-per-request-speculation",  # each params object (/slots, /props, an answer's)
    "draft_by_type": "0003-server-draft-counts-per-type",  # timings, beside draft_n, when a slot drafted
}


def without_patch_keys(answer: Any) -> Any:
    """`answer` less the keys of PATCH_KEYS, wherever they are."""
    if isinstance(answer, dict):
        return {k: without_patch_keys(v) for k, v in answer.items() if k not in PATCH_KEYS}
    if isinstance(answer, list):
        return [without_patch_keys(v) for v in answer]
    return answer


def json_type(value: Any) -> str:
    """The JSON type of a parsed value (an int and a float are both a number)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def shape_differences(recorded_answer: Any, answer: Any, where: str = "$") -> list[str]:
    """Where `answer` differs in shape from `recorded_answer`: a key one has and the other has not, or another JSON
    type, at any depth (an array's items compared in order, as far as both go); values may differ. [] when none."""
    kind, recorded_kind = json_type(answer), json_type(recorded_answer)
    if kind != recorded_kind:
        return [f"{where}: a {kind}, recorded a {recorded_kind}"]
    if kind == "object":
        out = [f"{where}.{k}: not answered" for k in sorted(recorded_answer.keys() - answer.keys())]
        out += [f"{where}.{k}: not recorded" for k in sorted(answer.keys() - recorded_answer.keys())]
        for k in sorted(recorded_answer.keys() & answer.keys()):
            out += shape_differences(recorded_answer[k], answer[k], f"{where}.{k}")
        return out
    if kind == "array":
        pairs = zip(recorded_answer, answer, strict=False)
        return [d for i, (r, a) in enumerate(pairs) for d in shape_differences(r, a, f"{where}[{i}]")]
    return []
