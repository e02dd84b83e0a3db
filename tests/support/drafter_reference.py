"""The counterfactual drafter as it was first written (one method call per token): the oracle the faster one in
`adaptive_spec.sessions.ngram_replay` is checked against, token for token."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from adaptive_spec.sessions.ngram_replay import SEPARATOR, DraftEstimate, NgramParams

_ADD_CHUNK = 32

_MOD = (1 << 61) - 1  # a Mersenne prime: rolling hashes of token windows, as ints (cheap keys, little memory)
_BASE = 1_000_003


class _Window:
    """The rolling hash of the last `n` tokens since the last separator."""

    __slots__ = ("hash", "n", "run", "tokens", "top")

    def __init__(self, n: int) -> None:
        self.n = n
        self.top = pow(_BASE, n - 1, _MOD)
        self.hash = 0
        self.run = 0
        self.tokens: list[int] = []

    @property
    def full(self) -> bool:
        return self.run >= self.n

    def push(self, token: int) -> None:
        if token == SEPARATOR:
            self.hash, self.run, self.tokens = 0, 0, []
            return
        if self.run >= self.n:
            self.hash = ((self.hash - self.tokens[0] * self.top) * _BASE + token) % _MOD
            del self.tokens[0]
        else:
            self.hash = (self.hash * _BASE + token) % _MOD
        self.tokens.append(token)
        self.run += 1

    def copy(self) -> _Window:
        other = _Window.__new__(_Window)
        other.n, other.top, other.hash, other.run, other.tokens = (
            self.n,
            self.top,
            self.hash,
            self.run,
            list(self.tokens),
        )
        return other


class RefNgramIndex:
    """A session's n-gram table over its token stream, bounded to about the newest `max_tokens` tokens."""

    __slots__ = ("_recent", "_table", "_window", "indexed", "max_tokens", "n")

    def __init__(self, n_match: int, max_tokens: int) -> None:
        self.n = n_match
        self.max_tokens = max(max_tokens, 4 * n_match)
        self.indexed = 0  # tokens appended since the last trim
        self._window = _Window(n_match)
        self._table: dict[int, int] = {}
        self._recent: list[int] = []  # the newest tokens, kept to rebuild the table when it is trimmed

    def __len__(self) -> int:
        return self.indexed

    @property
    def window(self) -> _Window:
        return self._window

    def lookup(self, key: int) -> int | None:
        return self._table.get(key)

    def extend(self, new: Iterable[int]) -> int:
        """Append tokens, indexing each n-gram; returns how many of them the table predicted before the append."""
        window, table, recent = self._window, self._table, self._recent
        predicted = 0
        count = 0
        for token in new:
            if window.full and token != SEPARATOR:
                key = window.hash
                if table.get(key) == token:
                    predicted += 1
                table[key] = token
            window.push(token)
            recent.append(token)
            count += 1
        self.indexed += count
        if self.indexed > self.max_tokens:
            self._trim()
        return predicted

    def _trim(self) -> None:
        # Keep the newest three quarters and rebuild: amortised O(1) per token, bounded memory.
        keep = self._recent[-(self.max_tokens * 3 // 4) :]
        self._table, self._recent, self._window, self.indexed = {}, [], _Window(self.n), 0
        self.extend(keep)

    def draft(self, window: _Window, n_max: int, n_min: int) -> list[int]:
        """ngram-mod's draft after `window` (the stream's last n tokens); empty when shorter than `n_min`."""
        if not window.full:
            return []
        get, top = self._table.get, window.top
        key, w = window.hash, list(window.tokens)
        out: list[int] = []
        for j in range(n_max):
            token = get(key)
            if token is None:
                break
            out.append(token)
            key = ((key - w[j] * top) * _BASE + token) % _MOD
            w.append(token)
        return out if len(out) >= n_min else []

    def memory_bytes(self) -> int:
        """Rough resident size: ~64 bytes a table entry, ~16 a token (131,072 distinct tokens: 10.3 MiB measured)."""
        return len(self._table) * 64 + len(self._recent) * 16


def ref_estimate_drafts(index: RefNgramIndex, output: Sequence[int], params: NgramParams) -> DraftEstimate:
    """Replay `output` as if an ngram-mod drafter had run while it was generated; `index` grows as it goes."""
    drafted = accepted = drafts = runs = 0
    pending: list[int] = []  # generated tokens not yet in the table (ngram-mod adds them 32 at a time)
    window = index.window.copy()  # the stream's tail, including pending tokens
    i, m = 0, len(output)
    while i < m:
        draft = index.draft(window, params.n_max, params.n_min)
        step = 1
        if draft:
            hit = 0
            for want, got in zip(draft, output[i:], strict=False):
                if want != got:
                    break
                hit += 1
            drafts += 1
            drafted += len(draft)
            accepted += hit
            runs += hit > 0
            step = hit + 1
        for token in output[i : i + step]:
            window.push(token)
            pending.append(token)
        i += step
        if len(pending) >= _ADD_CHUNK:
            index.extend(pending)
            pending = []
    if pending:
        index.extend(pending)
    return DraftEstimate(m, drafted, accepted, drafts, runs)
