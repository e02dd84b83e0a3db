"""What one proxy tells the others as it happens (Redis pub/sub, kept under a key where a proxy that starts later
needs it too): a head it saved (with where its file is), heads it removed, a restore its server made inert, a
server whose slots it saw emptied or restarted.

Pure: encoded and decoded here; sent and kept by `store.py`'s implementations, acted on by `heads.py`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True, slots=True)
class HeadSaved:
    """A head saved from a server through `proxy`: its index entry (`HeadEntry.to_json`), its file's path where
    `proxy` keeps it (read by the others that reach that folder), and a digest of `proxy`'s tenants (its project keys
    and their projects): a proxy that maps keys to projects otherwise does not take it."""

    proxy: str
    head: str
    entry: dict[str, Any]
    path: str
    tenants: str


@dataclass(frozen=True, slots=True)
class HeadsGone:
    """Heads removed through `proxy`: damaged (a checksum or a size that does not hold), or deleted by a user."""

    proxy: str
    heads: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class HeadInert:
    """A restore of `head` on `server` its request did not reuse: the head is not restored there for `head_s`; with
    `server_s`, restores pause on that server that long."""

    proxy: str
    server: str
    head: str
    head_s: float
    server_s: float = 0.0


@dataclass(frozen=True, slots=True)
class SlotsErased:
    """The server's slots hold no session's KV any more as of `stamp_ns` (the writer's wall clock): erased through
    `proxy`, or the server restarted (`restarted`)."""

    proxy: str
    server: str
    restarted: bool
    stamp_ns: int


News = HeadSaved | HeadsGone | HeadInert | SlotsErased
_KINDS: dict[str, type[HeadSaved | HeadsGone | HeadInert | SlotsErased]] = {
    "head": HeadSaved,
    "gone": HeadsGone,
    "inert": HeadInert,
    "erased": SlotsErased,
}
_NAMES = {kind: name for name, kind in _KINDS.items()}


def encode(news: News) -> bytes:
    fields = {name: getattr(news, name) for name in news.__slots__}
    return orjson.dumps({"kind": _NAMES[type(news)], **fields})


def decode(raw: bytes | str | None) -> News | None:
    """None for nothing, or for what does not read as news (another version wrote it)."""
    if raw is None:
        return None
    try:
        data: Any = orjson.loads(raw)
        kind = _KINDS[data.pop("kind")]
        if kind is HeadsGone:
            return HeadsGone(str(data["proxy"]), tuple(str(h) for h in data["heads"]))
        news = kind(**data)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        return None
    return news if _typed(news) else None


def _typed(news: News) -> bool:
    if isinstance(news, HeadSaved):
        return isinstance(news.entry, dict) and all(isinstance(v, str) for v in (news.head, news.path, news.tenants))
    if isinstance(news, HeadInert):
        return isinstance(news.head_s, int | float) and isinstance(news.server_s, int | float)
    if isinstance(news, SlotsErased):
        return isinstance(news.stamp_ns, int) and isinstance(news.restarted, bool)
    return True
