"""The head stores of several proxies kept in step through the shared state: what one saves, removes or finds inert
is told (`SharedHeads` is the store's `HeadsTold`), and what the others tell is done here (`heard`); the forward counts
all proxies keep are what the store's save and restore guards compare (`SharedHeads` is its `SharedForwards`).

A head another proxy saved is taken by this one from that proxy's folder (a hard link, or a copy; its size and
checksum checked as it is taken): every proxy that may restore it must reach that folder (one host, or a shared
filesystem mounted at the same path). A head is taken only from a proxy with the same tenants (project keys and their
projects): a head's chain is keyed by its tenant's name, and two mappings of keys to names must not meet."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from adaptive_spec.kv.heads.activity import Counted
from adaptive_spec.kv.heads.matching import HeadEntry
from adaptive_spec.kv.heads.store import HeadStore
from adaptive_spec.shared_state.news import HeadInert, HeadSaved, HeadsGone, News
from adaptive_spec.shared_state.shell import SharedState


def tenants_digest(project_keys: Mapping[str, str]) -> str:
    """A digest of the keys and the projects they name: equal on proxies that scope heads alike."""
    h = hashlib.blake2b(digest_size=16, person=b"as-tenants")
    for key, project in sorted(project_keys.items()):
        h.update(len(key).to_bytes(4, "big") + key.encode("utf-8", "surrogateescape"))
        h.update(len(project).to_bytes(4, "big") + project.encode("utf-8", "surrogateescape"))
    return h.hexdigest()


class SharedHeads:
    def __init__(self, shared: SharedState, project_keys: Mapping[str, str]) -> None:
        self._shared, self._tenants = shared, tenants_digest(project_keys)
        self.store: HeadStore | None = None  # set once the store is made (it is made with this as its `told`)

    # -- told: what this proxy's store did -------------------------------------------------------------------------

    def saved(self, entry: HeadEntry, path: Path) -> None:
        news = HeadSaved(self._shared.proxy_id, entry.id, entry.to_json(), str(path.absolute()), self._tenants)
        self._shared.tell(news)

    def gone(self, heads: Sequence[str]) -> None:
        if heads:
            self._shared.tell(HeadsGone(self._shared.proxy_id, tuple(heads)))

    def inert(self, server: str, head: str, head_s: float, server_s: float) -> None:
        self._shared.tell(HeadInert(self._shared.proxy_id, server, head, head_s, server_s))

    async def warm_claim(self, server: str) -> bool:
        return await self._shared.claim_warm(server)

    # -- the forward counts all proxies keep (the store's `SharedForwards`) -----------------------------------------

    def booked(self, request_id: str) -> Counted | None:
        return self._shared.counted(request_id)

    async def read(self, server: str, slot: int | None) -> Counted | None:
        return await self._shared.forwards(server, slot)

    # -- heard: what the others' stores did ------------------------------------------------------------------------

    async def heard(self, news: News) -> None:
        store = self.store
        if store is None:
            return
        if isinstance(news, HeadSaved):
            entry = HeadEntry.from_json(news.entry)
            # The id names its file here: a hex digest, nothing else.
            ok = entry is not None and entry.id == news.head and re.fullmatch("[0-9a-f]{8,64}", entry.id)
            if entry is not None and ok and news.tenants == self._tenants:
                await store.adopt(entry, Path(news.path))
        elif isinstance(news, HeadsGone):
            await store.heard_gone(news.heads)
        elif isinstance(news, HeadInert):
            store.heard_inert(news.server, news.head, news.head_s, news.server_s)
