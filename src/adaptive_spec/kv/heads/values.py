"""The head store's values: its settings, what a route sees of the heads on a server, a head restored for a request,
what the store's tables show of a served request, and a served turn to keep."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from adaptive_spec.kv.heads.activity import Counted, TurnMark
from adaptive_spec.kv.heads.matching import DEFAULT_MAX_BYTES, HeadEntry, ServerKey


@dataclass(frozen=True, slots=True)
class HeadsConfig:
    directory: Path | None  # None: heads/ in the state directory (resolved where `serve` starts)
    max_bytes: int = DEFAULT_MAX_BYTES
    build: str = ""  # the launched binary's identity ("": attached servers, known by their build_info alone)
    cache_types: tuple[str, str] = ("", "")  # the launched servers' K and V cache types ("": unknown)
    warm_start: bool = True  # restore the most recent heads into a fresh server's idle slots (start, restart)
    # `serve --project-key` (key: project): projects are tenants, a head is found within its key's project only.
    project_keys: Mapping[str, str] = field(default_factory=dict, repr=False)
    # Where the model files' sha256 are kept across runs (by device, inode, size and mtime); None: this run only.
    digests: Path | None = None


@dataclass(frozen=True, slots=True)
class Restored:
    """A head restored for one request: checked against that request's `cache_n` when it ends. `forwards`: the
    requests forwarded to that server before the restore (another one in between may have taken the slot)."""

    head: str
    server: str
    tokens: int
    restore_ms: float
    at_start: bool = False
    forwards: int = 0
    pieces: int = 0  # the request's leading pieces the head holds
    blocks: int = 0  # and the leading blocks of the next piece (a head the prompt parts from inside a piece)
    head_tokens: int = 0  # the head's own prompt tokens, where the request shares only a part of them
    # The forward counts all proxies share, read once the restore ended (shared state): any request counted since the
    # request's booking may have come between the restore and the request.
    counted: Counted | None = None

    def reason(self) -> str:
        when = " when the server started" if self.at_start else ""
        of = f", {self.tokens} of them this prompt's" if self.head_tokens > self.tokens else ""
        return (
            f"warm: head of {max(self.tokens, self.head_tokens)} tokens restored{when} in {self.restore_ms:.0f} ms{of}"
        )


@dataclass(frozen=True, slots=True)
class TurnShown:
    """What the store's tables show of a served request (`HeadStore.ended`), plain data the router decides its save on
    (`routing/move_planner.plan_save`), as it decides a restore on a `HeadsView`: whether it was its session's first
    request the store saw there (`first`), the head restored for it, and its slot's mark as it was forwarded."""

    first: bool = False
    restored: Restored | None = None
    mark: TurnMark | None = None


@dataclass(frozen=True, slots=True)
class SavedTurn:
    """A served first turn to keep as a head: its prompt's pieces, its tokens and reply's, whose it is."""

    pieces: tuple[bytes, ...]
    chars: tuple[int, ...]
    prompt_tokens: int
    reply_tokens: int
    agent: str | None
    project: str | None
    scope: str
    session: str = ""  # "": an agent's head; else the session whose state this is (saved once it went idle)
    blocks: tuple[tuple[bytes, ...], ...] = ()  # each piece's `text_blocks` (a first turn's; () for a session's state)


@dataclass(frozen=True, slots=True)
class HeadsView:
    """The heads a session's first request may get restored on one server, as the store sees them when the request is
    routed: gathered by the request path before `route()` (`HeadStore.view`), plain data the router decides on."""

    server: str  # its base URL
    key: ServerKey
    scope: str  # the tenant scope of the request's key (`matching.tenant_scope`)
    entries: tuple[HeadEntry, ...]  # the heads usable there: none it refused, none whose restore was inert there
    held: Mapping[int, Restored]  # by slot: the head it holds, no request having come to the server since
    restore_bytes_per_s: float
    any_prefix: bool  # the server resumes a restored slot at any token (`SlotIO.any_prefix`)


class HeadsTold(Protocol):
    """Whom the store tells what other proxies' head stores should know (`shared_state/heads.py`; by default no
    one): a head saved and where its file is, heads removed, a restore its server made inert; and whom it asks
    whether it warm-starts a server it found fresh (one proxy does)."""

    def saved(self, entry: HeadEntry, path: Path) -> None: ...

    def gone(self, heads: Sequence[str]) -> None: ...

    def inert(self, server: str, head: str, head_s: float, server_s: float) -> None: ...

    async def warm_claim(self, server: str) -> bool: ...


class NoOneTold:
    """One proxy alone: nothing is told."""

    def saved(self, entry: HeadEntry, path: Path) -> None:
        return None

    def gone(self, heads: Sequence[str]) -> None:
        return None

    def inert(self, server: str, head: str, head_s: float, server_s: float) -> None:
        return None

    async def warm_claim(self, server: str) -> bool:
        return True
