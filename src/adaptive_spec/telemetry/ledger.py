"""What each llama-server counted that its records do not say (a client that hung up mid-stream, an answer without final
timings): its `/metrics` counters at quiet moments against the sums of the records between, so one unseen request
gets exactly what it cost.

llama-server counts a cancelled request's prompt, tokens and drafts, some of them after the cancel; an Anthropic or
Responses answer carries usage, not timings (no cache split, no drafts). The ledger keeps, per server, llama-server's
counters at the last quiet moment and the sums of the records ended since; at the next quiet moment the difference is
what the unseen requests did, and with exactly one of them it is that request's count, exact.

Pure: the shell (requests/accounting.py) reads `/metrics` and says when it did; a reading is quiet when nothing the
proxy forwarded was open across it and llama-server had nothing in processing or deferred."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

# llama-server's counters (`--metrics`), by the timings field each sums.
COUNTERS = {
    "prompt_n": "llamacpp:prompt_tokens_total",
    "cache_n": "llamacpp:prompt_tokens_cached_total",
    "predicted_n": "llamacpp:tokens_predicted_total",
    "draft_n": "llamacpp:spec_decode_num_draft_tokens_total",
    "draft_n_accepted": "llamacpp:spec_decode_num_accepted_tokens_total",
    "prompt_ms": "llamacpp:prompt_seconds_total",
    "predicted_ms": "llamacpp:tokens_predicted_seconds_total",
}
BUSY = ("llamacpp:requests_processing", "llamacpp:requests_deferred")
_SECONDS = frozenset({"prompt_ms", "predicted_ms"})


@dataclass(frozen=True, slots=True)
class Counts:
    prompt_n: int = 0
    cache_n: int = 0
    predicted_n: int = 0
    draft_n: int = 0
    draft_n_accepted: int = 0
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0

    def __add__(self, other: Counts) -> Counts:
        return Counts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(Counts)))

    def __sub__(self, other: Counts) -> Counts:
        return Counts(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(Counts)))

    def whole(self) -> bool:
        """No token count below zero (the seconds are llama-server's sums of its own roundings: not checked)."""
        return all(getattr(self, f.name) >= 0 for f in fields(Counts) if f.name not in _SECONDS)

    def tokens(self) -> tuple[int, int, int, int, int]:
        return self.prompt_n, self.cache_n, self.predicted_n, self.draft_n, self.draft_n_accepted

    def clamped(self) -> Counts:
        """Its seconds at zero or more (a difference of roundings may fall a little below)."""
        return replace(self, prompt_ms=max(0.0, self.prompt_ms), predicted_ms=max(0.0, self.predicted_ms))


def from_metrics(values: dict[str, float]) -> Counts | None:
    """llama-server's counters from its `/metrics` values; None when one is missing (a build without them)."""
    if any(name not in values for name in COUNTERS.values()):
        return None
    n = {key: int(values[name]) for key, name in COUNTERS.items() if key not in _SECONDS}
    return Counts(
        n["prompt_n"],
        n["cache_n"],
        n["predicted_n"],
        n["draft_n"],
        n["draft_n_accepted"],
        values[COUNTERS["prompt_ms"]] * 1000.0,
        values[COUNTERS["predicted_ms"]] * 1000.0,
    )


def busy(values: dict[str, float]) -> bool:
    return any(values.get(name, 0.0) > 0 for name in BUSY)


@dataclass(slots=True)
class _Book:
    reading: Counts | None = None  # llama-server's counters at the last quiet reading
    forwards: int = 0  # requests forwarded to it, ever
    open: int = 0  # forwarded and not ended
    since: Counts = field(default_factory=Counts)  # the records' counts, ended since the reading
    unseen: list[str] = field(default_factory=list)  # requests ended since the reading whose counts were not seen
    known: Counts | None = None  # of the one unseen request, the token counts its answer did say (usage), if any
    shared: bool = False  # llama-server counted work no request through the proxy did: another client uses it


@dataclass(frozen=True, slots=True)
class Settled:
    """What a quiet reading settled: the counts of the one unseen request (`counts` None when there were several, or
    the difference did not add up: another client used the server), and which requests it settles."""

    requests: tuple[str, ...]
    counts: Counts | None
    other: Counts | None = None  # counted by llama-server with no unseen request to give it to (nothing: None)


class Ledger:
    def __init__(self) -> None:
        self._books: dict[str, _Book] = {}

    def forwarded(self, server: str) -> None:
        book = self._books.setdefault(server, _Book())
        book.forwards += 1
        book.open += 1

    def ended(self, server: str, request_id: str, counts: Counts | None, known: Counts | None = None) -> bool:
        """A forwarded request ended, with the counts its answer said (None: not seen to its end; `known`: the token
        counts it did say, an Anthropic or Responses usage). True: its counts wait for the next quiet reading."""
        book = self._books.setdefault(server, _Book())
        book.open = max(0, book.open - 1)
        if counts is not None:
            book.since = book.since + counts
            return False
        if book.reading is None or (book.shared and known is None):
            return False  # nothing to compare with (or to check against): it stays as the answer showed it
        book.unseen.append(request_id)
        book.known = known
        return True

    def quiet(self, server: str) -> int | None:
        """The forwards count a reading starts from when the server is quiet for the proxy (nothing open), else
        None."""
        book = self._books.setdefault(server, _Book())
        return book.forwards if book.open == 0 else None

    def read(self, server: str, started_at: int, counters: Counts) -> Settled | None:
        """llama-server's counters, read while it had nothing in processing; `started_at` from `quiet`. None: the
        reading is not a quiet one (a request was forwarded across it) and is dropped."""
        book = self._books.setdefault(server, _Book())
        if book.forwards != started_at or book.open != 0:
            return None
        last, unseen, since, known = book.reading, tuple(book.unseen), book.since, book.known
        book.reading, book.unseen, book.since, book.known = counters, [], Counts(), None
        if last is None:
            return Settled((), None) if not unseen else Settled(unseen, None)
        left = counters - last - since
        if not unseen:
            other = None if left.tokens() == (0, 0, 0, 0, 0) else left
            book.shared = book.shared or other is not None
            return Settled((), None, other)
        if len(unseen) == 1 and left.whole() and (known is None or left.tokens()[:3] == known.tokens()[:3]):
            return Settled(unseen, left.clamped())
        book.shared = book.shared or len(unseen) == 1  # one request, and its usage does not add up: another client
        return Settled(unseen, None)

    def waiting(self, server: str) -> bool:
        book = self._books.get(server)
        return book is not None and bool(book.unseen)

    def forget(self, server: str) -> tuple[str, ...]:
        """The server restarted (its counters start again): its unseen requests are not settled."""
        book = self._books.pop(server, None)
        return tuple(book.unseen) if book is not None else ()
