"""llama-server's slot API, and moving a session's KV slot from one llama-server to another through it.

`slot_action` is the one client of `POST /slots/{id}?action=save|restore|erase` (handoffs, remote prefill, the erase
endpoint and the kv-relay's prefill all go through it). A move saves the slot on the source, gets the file to the
target and restores it there: `SlotMover` is the seam, `SharedDirMover` the case where both servers write slot
files into one directory (the same host, or a shared filesystem); the mover between hosts (`kv/relay_mover.py`, a
relay beside each server) implements the same protocol and is priced by the same cost model (`kv/costs.py`)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp

from adaptive_spec.servers.upstreams import Upstream


class SlotError(Exception):
    """A slot action failed; the request is forwarded anyway and re-prefills. `status`: llama-server's HTTP status
    when it answered with an error."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class MoveRequest:
    """One slot file's move: saved from `from_slot` of `source` as `name`, restored into `into_slot` of `target`.
    A save that wrote fewer than `min_tokens` tokens captured another session's KV, and is not restored."""

    source: Upstream
    from_slot: int
    target: Upstream
    into_slot: int
    name: str
    timeout_s: float  # each slot action's deadline
    min_tokens: int

    @property
    def timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.timeout_s)


@dataclass(frozen=True, slots=True)
class MoveTimes:
    n_saved: int
    save_s: float
    restore_s: float
    transfer_s: float = 0.0  # a mover between hosts: the file's trip from one host to the other
    bytes: int = 0  # the slot file's size, when it crossed hosts (bytes per token, bandwidth: learned from it)


class SlotMover(Protocol):
    def can_move(self, source: Upstream, target: Upstream) -> bool:
        """Whether a slot file saved by `source` can be restored by `target`."""
        ...

    def transfers(self, source: Upstream, target: Upstream) -> bool:
        """Whether the file crosses hosts between these two (the cost model adds its transfer time)."""
        ...

    async def move(self, client: aiohttp.ClientSession, move: MoveRequest) -> MoveTimes:
        """Save, transfer, restore; raises SlotError (or aiohttp's errors) on any failure."""
        ...

    async def discard(self, name: str) -> None:
        """Remove the file wherever the move left it (whatever the outcome)."""
        ...


class SharedDirMover:
    """Both servers save into and restore from one `--slot-save-path` directory."""

    def __init__(self, slot_dir: Path) -> None:
        self.slot_dir = slot_dir

    def can_move(self, source: Upstream, target: Upstream) -> bool:
        # A router-mode preset (`URL#MODEL`) takes no slot actions.
        return source.upstream_model is None and target.upstream_model is None

    def transfers(self, source: Upstream, target: Upstream) -> bool:
        return False

    async def move(self, client: aiohttp.ClientSession, move: MoveRequest) -> MoveTimes:
        t0 = time.perf_counter()
        n_saved, n_written = await save_slot(
            client, move.source, move.from_slot, move.name, move.timeout, move.min_tokens
        )
        t1 = time.perf_counter()
        await self._check_file(move.source, move.name, n_written)
        await restore_slot(client, move.target, move.into_slot, move.name, move.timeout, n_saved)
        return MoveTimes(n_saved, t1 - t0, time.perf_counter() - t1)

    async def discard(self, name: str) -> None:
        await asyncio.to_thread(_unlink, self.slot_dir / name)

    async def _check_file(self, source: Upstream, name: str, n_written: object) -> None:
        """The saved file must be whole before another server restores it: llama-server aborts (GGML_ASSERT in
        state_seq_load_file) on a slot file that is cut short, say by a full disk."""
        await asyncio.to_thread(check_written, self.slot_dir / name, n_written, source.label)


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


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)
