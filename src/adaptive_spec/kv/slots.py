"""llama-server's slot API: `slot_action` is the one client of `POST /slots/{id}?action=save|restore|erase` (handoffs,
remote prefill, the head store, the erase endpoint and the kv-relay's prefill all go through it), with the checks of a
save's and a restore's answers (`save_slot`, `restore_slot`, `check_written`).

The movers that carry a slot from one server to another through it are `kv/movers.py`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from adaptive_spec.llama.upstreams import Upstream


class SlotError(Exception):
    """A slot action failed; the request is forwarded anyway and re-prefills. `status`: llama-server's HTTP status
    when it answered with an error."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def check_written(path: Path, n_written: object, label: str) -> None:
    """A slot file holds the `n_written` bytes llama-server said it wrote (not said: nothing to check), else
    SlotError: llama-server aborts on restoring a file cut short. Synchronous: callers run it in a thread."""
    if not isinstance(n_written, int):
        return
    size = _size(path)
    if size != n_written:
        raise SlotError(f"the slot file {label} saved has {size} of its {n_written} bytes (disk full?): not used")


async def save_slot(
    client: aiohttp.ClientSession,
    source: Upstream,
    slot: int,
    name: str,
    timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 - one deadline per slot action
    min_tokens: int,
) -> tuple[int, object]:
    """Save the slot into `name`: (tokens saved, bytes written as llama-server says). Fewer than `min_tokens` saved
    means the slot was reused by another session: SlotError."""
    saved = await slot_action(client, source, slot, "save", name, timeout)
    n_saved = int(saved.get("n_saved") or 0)
    if n_saved < min_tokens:
        raise SlotError(
            f"save on {source.label} slot {slot} wrote {n_saved} tokens, not the session's "
            f"{min_tokens} or more (its slot was reused)"
        )
    return n_saved, saved.get("n_written")


async def restore_slot(
    client: aiohttp.ClientSession,
    target: Upstream,
    slot: int,
    name: str,
    timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 - one deadline per slot action
    n_saved: int,
) -> None:
    """Restore `name` into the slot; anything but all `n_saved` tokens restored is a SlotError."""
    restored = await slot_action(client, target, slot, "restore", name, timeout)
    if int(restored.get("n_restored") or -1) != n_saved:
        raise SlotError(f"restore on {target.label} restored {restored.get('n_restored')} of {n_saved} tokens")


async def slot_action(
    client: aiohttp.ClientSession,
    upstream: Upstream,
    slot: int,
    action: str,
    filename: str | None,
    timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 - one deadline per slot action
) -> dict[str, Any]:
    """`POST /slots/{slot}?action=…` (a router-mode preset named as `model=`): llama-server's answer, or SlotError.

    Sent again once when the server drops the connection before answering: a pooled keep-alive connection it had just
    closed (seen as "Server disconnected" on an erase after a long idle stream). Every slot action may be repeated:
    a save writes the same file, a restore loads it again, an erase empties what is empty."""
    model = f"&model={quote(upstream.upstream_model, safe='')}" if upstream.upstream_model else ""
    url = f"{upstream.base_url}/slots/{slot}?action={action}{model}"
    body = {"filename": filename} if filename is not None else None
    try:
        return await _slot_post(client, upstream, slot, action, url, body, timeout)
    except aiohttp.ServerDisconnectedError:
        return await _slot_post(client, upstream, slot, action, url, body, timeout)


async def _slot_post(
    client: aiohttp.ClientSession,
    upstream: Upstream,
    slot: int,
    action: str,
    url: str,
    body: dict[str, str] | None,
    timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 - one deadline per slot action
) -> dict[str, Any]:
    async with client.post(url, json=body, timeout=timeout) as resp:
        if resp.status != 200:
            text = _error_message(await resp.text())
            raise SlotError(f"{action} on {upstream.label} slot {slot}: HTTP {resp.status}: {text}", resp.status)
        answer = await resp.json(content_type=None)
    if not isinstance(answer, dict):
        raise SlotError(f"{action} on {upstream.label} slot {slot}: unexpected answer {str(answer)[:200]}")
    return answer


def _error_message(text: str) -> str:
    """llama-server's words in an error answer (its OpenAI-shaped body's message), one line of at most 300
    characters: a handoff's reason goes into records and logs."""
    try:
        body = json.loads(text)
        message = str(body["error"]["message"]) if isinstance(body, dict) else text
    except (ValueError, KeyError, TypeError):
        message = text
    return " ".join(message.split())[:300]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1
