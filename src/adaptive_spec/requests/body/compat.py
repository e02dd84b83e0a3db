"""Request shapes an agent sends that llama-server refuses, rewritten into ones it takes, and answers of llama-server
an agent misreads, worded as its own API words them (pure).

Codex CLI 0.171 puts tool outputs of its own in the Responses `input` without a `call_id` (its goal feature's
`{"type": "function_call_output", "name": "goal_objective", "namespace": "agent", "output": …}`). llama-server
(b11434) converts a `function_call_output` only with its `call_id`, and refuses the whole request otherwise (400
"Cannot determine type of 'item'"): the agent's turn fails. Such an output answers no call of the model's, so it
goes on as what it is, context for the model: a user message naming the output.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from adaptive_spec.requests.apis import Api


@dataclass(frozen=True, slots=True)
class Repaired:
    body: dict[str, Any]
    note: str  # what was rewritten, for the record


def repaired(api: Api, body: Mapping[str, Any]) -> Repaired | None:
    """The body with the shapes llama-server refuses rewritten; None when there are none."""
    items = body.get("input") if api is Api.RESPONSES else None
    if not isinstance(items, list):
        return None
    found = [i for i, item in enumerate(items) if _callless_output(item)]
    if not found:
        return None
    rewritten = list(items)
    names = []
    for i in found:
        item = items[i]
        output = item.get("output")
        text = output if isinstance(output, str) else orjson.dumps(output).decode()
        name = str(item.get("name") or "tool output")
        names.append(name)
        rewritten[i] = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": f"{name}: {text}"}],
        }
    note = f"{len(found)} function_call_output without a call_id ({', '.join(names)}) sent as a user message"
    return Repaired({**body, "input": rewritten}, note)


def _callless_output(item: Any) -> bool:
    return (
        isinstance(item, Mapping)
        and item.get("type") == "function_call_output"
        and not isinstance(item.get("call_id"), str)
    )


def anthropic_overflow(body: bytes) -> dict[str, Any] | None:
    """llama-server's context overflow (`exceed_context_size_error`, with `n_prompt_tokens` and `n_ctx`) in the
    shape Anthropic answers it: `invalid_request_error`, "prompt is too long: N tokens > M maximum". Claude Code
    assumes a 1M-token window for a model it does not know, so it meets llama-server's limit only here; it takes
    Anthropic's wording as an overflow (2.1.328 also knows llama-server's) and reads from it how many tokens over
    the limit it is, which its compaction uses. None: not an overflow."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    error = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(error, dict) or error.get("type") != "exceed_context_size_error":
        return None
    tokens, limit = error.get("n_prompt_tokens"), error.get("n_ctx")
    if not isinstance(tokens, int) or not isinstance(limit, int) or isinstance(tokens, bool) or isinstance(limit, bool):
        return None
    message = f"prompt is too long: {tokens} tokens > {limit} maximum"
    return {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
