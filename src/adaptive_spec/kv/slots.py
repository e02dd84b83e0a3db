"""Moving a session's KV slot from one llama-server to another: save it on the source, get the file to the target,
restore it there. `SlotMover` is the seam: `SharedDirMover` is the case where both servers write slot files into one
directory (the same host, or a shared filesystem); a mover between hosts (a relay beside each server that streams
the file across) implements the same protocol and is priced by the same cost model (`SpeedModel.handoff_s`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from adaptive_spec.servers.upstreams import Upstream


class SlotError(Exception):
    """A slot action failed; the request is forwarded anyway and re-prefills."""


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

    async def move(
        self,
        client: aiohttp.ClientSession,
        source: Upstream,
        from_slot: int,
        target: Upstream,
        into_slot: int,
        name: str,
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 - one deadline per slot action
        min_tokens: int,
    ) -> MoveTimes:
        """Save, transfer, restore; raises SlotError (or aiohttp's errors) on any failure. `min_tokens`: a save that
        wrote fewer tokens than this captured another session's KV, and is not restored."""
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

    async def move(
        self,
        client: aiohttp.ClientSession,
        source: Upstream,
        from_slot: int,
        target: Upstream,
        into_slot: int,
        name: str,
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 - one deadline per slot action
        min_tokens: int,
    ) -> MoveTimes:
        t0 = time.perf_counter()
        n_saved, n_written = await save_slot(client, source, from_slot, name, timeout, min_tokens)
        t1 = time.perf_counter()
        await self._check_file(source, name, n_written)
        await restore_slot(client, target, into_slot, name, timeout, n_saved)
        return MoveTimes(n_saved, t1 - t0, time.perf_counter() - t1)

    async def discard(self, name: str) -> None:
        await asyncio.to_thread(_unlink, self.slot_dir / name)

    async def _check_file(self, source: Upstream, name: str, n_written: object) -> None:
        """The saved file must be whole before another server restores it: llama-server aborts (GGML_ASSERT in
        state_seq_load_file) on a slot file that is cut short, say by a full disk."""
        if not isinstance(n_written, int):
            return
        size = await asyncio.to_thread(_size, self.slot_dir / name)
        if size != n_written:
            raise SlotError(
                f"the slot file {source.label} saved has {size} of its {n_written} bytes (disk full?); not restoring it"
            )


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
    filename: str,
    timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 - one deadline per slot action
) -> dict[str, Any]:
    url = f"{upstream.base_url}/slots/{slot}?action={action}"
    async with client.post(url, json={"filename": filename}, timeout=timeout) as resp:
        if resp.status != 200:
            text = (await resp.text())[:300]
            raise SlotError(f"{action} on {upstream.label} slot {slot}: HTTP {resp.status} {text}")
        body = await resp.json(content_type=None)
    if not isinstance(body, dict):
        raise SlotError(f"{action} on {upstream.label} slot {slot}: unexpected answer {str(body)[:200]}")
    return body


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)
