"""Claude Code's attribution line in an Anthropic `system` prompt, read as llama-server reads it (pure).

Claude Code (2.1 and later) opens `system` with a text block `x-anthropic-billing-header: cc_version=…;
cc_entrypoint=…; cch=1a2b3;` whose `cch` value changes with every request. llama-server writes `fffff` in its place
(tools/server/server-chat.cpp, llama.cpp PR #21793), so its cached prefix holds from one turn to the next; the
proxy's digests of a prompt see the same text, else every turn would look like a new prompt and a side request.
"""

from __future__ import annotations

from typing import Any

_BILLING_LINE = "x-anthropic-billing-header:"
_CCH = "cch="
_CCH_CHARS = 5


def normalised_billing_line(text: str) -> str:
    """A system text block as llama-server renders it: the five characters after `cch=` become `fffff` when a `;`
    follows them, in a block that starts with the attribution line; any other text is kept as it is."""
    if not text.startswith(_BILLING_LINE):
        return text
    at = text.find(_CCH, len(_BILLING_LINE))
    if at < 0:
        return text
    start = at + len(_CCH)
    end = start + _CCH_CHARS
    if end < len(text) and text[end] == ";":
        return text[:start] + "f" * _CCH_CHARS + text[end:]
    return text  # not the shape llama-server rewrites: it keeps it as it is too


def normalised_system(system: Any) -> Any:
    """Anthropic's `system` (a string or text blocks) with each block's billing line normalised (a copy only when
    there is one)."""
    if isinstance(system, str):
        return normalised_billing_line(system)
    if not isinstance(system, list) or not any(_billing_block(b) for b in system):
        return system
    return [{**b, "text": normalised_billing_line(b["text"])} if _billing_block(b) else b for b in system]


def _billing_block(block: Any) -> bool:
    return isinstance(block, dict) and isinstance(block.get("text"), str) and block["text"].startswith(_BILLING_LINE)
