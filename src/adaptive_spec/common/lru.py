"""The bounded cache of the project: a dict that keeps at most `max_items` entries (and, optionally, at most
`max_weight` in total), dropping the least recently used first.

Tables keyed by session, slot or file use it; a few bounded structures that are not caches are not LRUs (the history's
and feeds' deques, the sessions service's capped queue of waiting updates, the metrics' capped project labels)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, KeysView
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    """`put` and `touch` make an entry the most recently used; `get` and `replace` leave the order alone. Entries
    beyond the bounds go oldest first, but the newest entry always stays, however heavy."""

    def __init__(
        self, max_items: int, *, max_weight: int | None = None, weigh: Callable[[V], int] | None = None
    ) -> None:
        self.max_items, self.max_weight = max_items, max_weight
        self._weigh = weigh or (lambda _value: 1)
        self._data: OrderedDict[K, V] = OrderedDict()
        self.weight = 0

    def get(self, key: K) -> V | None:
        return self._data.get(key)

    def touch(self, key: K) -> None:
        """Mark an entry as just used (if it is there)."""
        if key in self._data:
            self._data.move_to_end(key)

    def put(self, key: K, value: V) -> list[tuple[K, V]]:
        """Store `value` as the most recently used entry; returns the entries dropped to stay within the bounds."""
        if key in self._data:
            self.weight -= self._weigh(self._data.pop(key))
        self._data[key] = value
        self.weight += self._weigh(value)
        return self._shrink()

    def replace(self, key: K, value: V) -> None:
        """Change an entry's value without making it more recent (the key must be present)."""
        self.weight += self._weigh(value) - self._weigh(self._data[key])
        self._data[key] = value

    def pop(self, key: K) -> V | None:
        if key not in self._data:
            return None
        value = self._data.pop(key)
        self.weight -= self._weigh(value)
        return value

    def _shrink(self) -> list[tuple[K, V]]:
        dropped: list[tuple[K, V]] = []
        while len(self._data) > self.max_items or (
            self.max_weight is not None and self.weight > self.max_weight and len(self._data) > 1
        ):
            key, value = self._data.popitem(last=False)
            self.weight -= self._weigh(value)
            dropped.append((key, value))
        return dropped

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def keys(self) -> KeysView[K]:
        """A live view of the keys (set operations such as `isdisjoint` run in C over it)."""
        return self._data.keys()

    def __iter__(self) -> Iterator[K]:
        """Keys, least recently used first."""
        return iter(self._data)

    def __reversed__(self) -> Iterator[K]:
        return reversed(self._data)

    def items(self) -> list[tuple[K, V]]:
        """Entries, least recently used first."""
        return list(self._data.items())

    def values(self) -> list[V]:
        return list(self._data.values())
