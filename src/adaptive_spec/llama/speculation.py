"""Speculation chosen per request: the settings a profile's requests carry to a llama-server that takes them (the
project's patched build says so in `/props`), and the one server that runs several launched profiles as settings
of its own.

Pure: what to send and what the server offers, no HTTP.

A patched server takes, in a chat/completions or completions body, `"speculative.types"` (the subset of its
`--spec-type` list that may draft for this request; `[]`: none) and `"speculative.n_max"` (a cap on the tokens
drafted per step; 0: no drafting). A request naming neither behaves exactly as on a stock server. Its `/props` says
`"speculative_per_request": {"types": [...], "n_max": N}`; a stock server has no such key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from adaptive_spec.errors import ConfigError

TYPES_FIELD = "speculative.types"
N_MAX_FIELD = "speculative.n_max"
BODY_FIELDS = (TYPES_FIELD, N_MAX_FIELD)
PROPS_FIELD = "speculative_per_request"
# The one type that is not a drafter: llama-server lists it first in /slots, the patched /props leaves it out.
_NONE = "none"


@dataclass(frozen=True, slots=True)
class Speculation:
    """A profile's per-request speculation settings. `types`: the server's types that may draft (None: not named,
    the server's own; (): none); `n_max`: a cap on the tokens drafted per step (None: not named; 0: no drafting)."""

    types: tuple[str, ...] | None = None
    n_max: int | None = None

    @property
    def named(self) -> bool:
        return self.types is not None or self.n_max is not None

    def body_fields(self) -> dict[str, Any]:
        """The request fields that carry these settings (empty when nothing is named)."""
        out: dict[str, Any] = {}
        if self.types is not None:
            out[TYPES_FIELD] = list(self.types)
        if self.n_max is not None:
            out[N_MAX_FIELD] = self.n_max
        return out

    def drafting_types(self, server_types: Sequence[str]) -> tuple[str, ...]:
        """What may draft for these requests on a server started with `server_types`, as /slots spells a server's
        types (("none",) when nothing does)."""
        drafters = tuple(t for t in server_types if t != _NONE)
        if self.n_max == 0:
            drafters = ()
        elif self.types is not None:
            drafters = tuple(t for t in drafters if t in self.types)
        return drafters or (_NONE,)

    def describe(self) -> str:
        if not self.named:
            return "the server's own"
        parts = []
        if self.types is not None:
            parts.append(f"types={','.join(self.types) or 'none'}")
        if self.n_max is not None:
            parts.append(f"n_max={self.n_max}")
        return " ".join(parts)

    @classmethod
    def parse(cls, text: str, where: str) -> Speculation:
        """`types=A,B` and/or `n_max=N`, separated by ';' (`types=none` or `types=`: no type may draft)."""
        types: tuple[str, ...] | None = None
        n_max: int | None = None
        for item in text.split(";"):
            key, sep, value = item.partition("=")
            key = key.strip()
            if key == "types" and sep:
                names = tuple(t.strip() for t in value.split(",") if t.strip())
                types = () if names == (_NONE,) else names
            elif key == "n_max" and sep and value.strip().isdigit():
                n_max = int(value)
            else:
                raise ConfigError(f"{where}: {item!r} is not types=T1,T2 (or none) or n_max=N")
        return cls(types, n_max)


@dataclass(frozen=True, slots=True)
class PerRequestSupport:
    """What a patched server offers per request (its /props `speculative_per_request`): its configured types and the
    largest n_max a request may ask for."""

    types: tuple[str, ...]
    n_max: int

    @classmethod
    def from_props(cls, props: Mapping[str, Any]) -> PerRequestSupport | None:
        """None: a stock llama-server (no such key), or one whose key this proxy cannot read."""
        raw = props.get(PROPS_FIELD)
        if not isinstance(raw, dict):
            return None
        types, n_max = raw.get("types"), raw.get("n_max")
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            return None
        if not isinstance(n_max, int) or isinstance(n_max, bool):
            return None
        return cls(tuple(types), n_max)

    def problem(self, settings: Speculation) -> str | None:
        """Why a server offering this cannot take `settings` (it would answer every such request 400), or None."""
        unknown = [t for t in settings.types or () if t not in self.types]
        if unknown:
            offered = ", ".join(self.types) or "none"
            return f"speculation type {', '.join(unknown)} is not one the server was started with ({offered})"
        if settings.n_max is not None and not 0 <= settings.n_max <= self.n_max:
            return f"n_max={settings.n_max} is outside the server's 0..{self.n_max}"
        return None


def merge_fields(
    body: Mapping[str, Any], settings: Speculation, by: str = "profile"
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The fields to add to a request body for `settings`, and what the request then runs with, for its record (None:
    nothing named, the server's own behaviour). A client's own `speculative.*` field wins over the profile's (it asked
    for that setting by name; dropping it would be silent), and the record says who set what (`by`: the profile, or
    the router where it chose the draft length). One look at the body's top-level keys."""
    client = {k: v for k, v in body.items() if isinstance(k, str) and k.startswith("speculative.")}
    added = {k: v for k, v in settings.body_fields().items() if k not in client}
    fields = {**added, **client}
    if not fields:
        return added, None
    types = fields.get(TYPES_FIELD)
    record = {
        "types": types if isinstance(types, list | str) else None,
        "n_max": fields.get(N_MAX_FIELD),
        "set_by": "client" if client and not added else f"{by}+client" if client else by,
    }
    return added, record
