"""The one bounded cache: least recently used first out, the weight bound, order kept by get and replace."""

from __future__ import annotations

from adaptive_spec.common.lru import LRU


def test_the_least_recently_put_or_touched_goes_first() -> None:
    cache: LRU[str, int] = LRU(2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.touch("a")
    assert cache.put("c", 3) == [("b", 2)]
    assert list(cache) == ["a", "c"]
    assert cache.get("b") is None and cache.get("a") == 1


def test_get_and_replace_keep_the_order() -> None:
    cache: LRU[str, int] = LRU(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1
    cache.replace("a", 10)
    assert cache.put("c", 3) == [("a", 10)]


def test_putting_again_makes_an_entry_newest_without_counting_it_twice() -> None:
    cache: LRU[str, int] = LRU(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.put("a", 5) == []
    assert cache.items() == [("b", 2), ("a", 5)]
    assert len(cache) == 2


def test_the_weight_bound_drops_oldest_first_but_keeps_the_newest_however_heavy() -> None:
    cache: LRU[str, list[int]] = LRU(100, max_weight=5, weigh=len)
    cache.put("a", [1, 2])
    cache.put("b", [1, 2, 3])
    assert cache.weight == 5
    assert cache.put("c", [1]) == [("a", [1, 2])]
    assert cache.put("huge", list(range(9))) == [("b", [1, 2, 3]), ("c", [1])]
    assert list(cache) == ["huge"] and cache.weight == 9
    assert cache.pop("huge") == list(range(9)) and cache.weight == 0 and cache.pop("huge") is None
