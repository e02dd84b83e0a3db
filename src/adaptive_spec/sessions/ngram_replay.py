"""A counterfactual ngram-mod drafter: what n-gram drafting would have drafted and had accepted on a response.

It mirrors llama.cpp's ngram-mod (common/ngram-mod.cpp, common/speculative.cpp): a table from the hash of the last
`n_match` tokens to the token that followed them; a draft chains up to `n_max` lookups from the current tail and
is dropped when a lookup fails before `n_min` tokens; generated tokens join the table in chunks of 32. The verifier
accepts the longest prefix of a draft that equals what the model produced. Everything here is an estimate.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

SEPARATOR = -1  # between messages: no real token, so no n-gram spans two messages
_ADD_CHUNK = 32  # ngram-mod adds generated tokens' n-grams only once 32 new tokens have piled up


@dataclass(frozen=True, slots=True)
class NgramParams:
    n_match: int = 24
    n_min: int = 48
    n_max: int = 64


@dataclass(frozen=True, slots=True)
class DraftEstimate:
    """What the counterfactual drafter did over one response (all counts in the tokenizer's tokens)."""

    output_tokens: int
    drafted: int
    accepted: int
    drafts: int
    accepted_runs: int  # drafts with at least one accepted token

    @property
    def accepted_share(self) -> float:
        """Share of output tokens that accepted drafts would have produced."""
        return self.accepted / self.output_tokens if self.output_tokens else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_run(self) -> float:
        return self.accepted / self.drafts if self.drafts else 0.0


_MOD = (1 << 61) - 1  # a Mersenne prime: rolling hashes of token windows, as ints (cheap keys, little memory)
_BASE = 1_000_003


class _Window:
    """The rolling hash of the last `n` tokens since the last separator (advanced by `NgramIndex.extend`)."""

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


class NgramIndex:
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

    def copy(self) -> NgramIndex:
        """An independent index in the same state (~30x cheaper than indexing its tokens again)."""
        other = NgramIndex(self.n, self.max_tokens)
        other.indexed, other._table, other._recent = self.indexed, dict(self._table), list(self._recent)
        window = other._window
        window.hash, window.run, window.tokens = self._window.hash, self._window.run, list(self._window.tokens)
        return other

    @property
    def window(self) -> _Window:
        return self._window

    def extend(self, new: Iterable[int]) -> int:
        """Append tokens, indexing each n-gram; returns how many of them the table predicted before the append."""
        tokens = new if isinstance(new, list) else list(new)
        window, table = self._window, self._table
        n, top = self.n, window.top
        key, run = window.hash, window.run
        # The tokens since the last separator, grown as it goes: the one a step rolls out of the window is `seen[-n]`
        # (one local loop per token: a method call per token made this most of a statistics update).
        seen = window.tokens
        predicted = 0
        for token in tokens:
            if token == SEPARATOR:
                key, run, seen = 0, 0, []
                continue
            if run >= n:
                if table.get(key) == token:
                    predicted += 1
                table[key] = token
                key = ((key - seen[-n] * top) * _BASE + token) % _MOD
            else:
                key = (key * _BASE + token) % _MOD
            seen.append(token)
            run += 1
        window.hash, window.run, window.tokens = key, run, seen[-n:]
        self._recent.extend(tokens)
        self.indexed += len(tokens)
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
        out = self.draft_after(window.hash, window.tokens, n_max)
        return out if len(out) >= n_min else []

    def draft_after(self, key: int, last: Sequence[int], n_max: int) -> list[int]:
        """The chain of up to `n_max` lookups from `key`, the hash of `last` (the stream's last n tokens)."""
        get, top = self._table.get, self._window.top
        w = list(last)
        out: list[int] = []
        for j in range(n_max):
            token = get(key)
            if token is None:
                break
            out.append(token)
            key = ((key - w[j] * top) * _BASE + token) % _MOD
            w.append(token)
        return out

    def memory_bytes(self) -> int:
        """Rough resident size: ~64 bytes a table entry, ~16 a token (131,072 distinct tokens: 10.3 MiB measured)."""
        return len(self._table) * 64 + len(self._recent) * 16


def estimate_drafts(index: NgramIndex, output: Sequence[int], params: NgramParams) -> DraftEstimate:
    """Replay `output` as if an ngram-mod drafter had run while it was generated; `index` grows as it goes."""
    drafted = accepted = drafts = runs = 0
    n, n_max, n_min = index.n, params.n_max, params.n_min
    tail = index.window  # the stream's tail before the output; the replay's own window runs on from it
    top, key, run = tail.top, tail.hash, tail.run
    seen = list(tail.tokens)  # grown with the output: the token a step rolls out of the window is `seen[-n]`
    added = 0  # output[:added] is in the table (ngram-mod adds generated tokens 32 at a time)
    table = index._table
    i, m = 0, len(output)
    while i < m:
        step = 1
        if run >= n and key in table:  # most positions draft nothing: one lookup
            draft = index.draft_after(key, seen[-n:], n_max)
            if len(draft) >= n_min:
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
        if step == 1:
            token = output[i]
            key = ((key - seen[-n] * top) * _BASE + token) % _MOD if run >= n else (key * _BASE + token) % _MOD
            seen.append(token)
            run += 1
            i += 1
        else:
            for token in output[i : i + step]:
                key = ((key - seen[-n] * top) * _BASE + token) % _MOD if run >= n else (key * _BASE + token) % _MOD
                seen.append(token)
                run += 1
            i = min(i + step, m)
        if i - added >= _ADD_CHUNK:
            index.extend(list(output[added:i]))
            added, table = i, index._table  # a trim makes a new table
    if added < m:
        index.extend(list(output[added:]))
    return DraftEstimate(m, drafted, accepted, drafts, runs)
