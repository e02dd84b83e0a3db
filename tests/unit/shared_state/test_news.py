"""The news proxies tell each other: each kind reads back as written; what another version wrote, or nothing that
reads as news, is None (never an exception on the listener)."""

from __future__ import annotations

import pytest

from adaptive_spec.shared_state.news import HeadInert, HeadSaved, HeadsGone, News, SlotsErased, decode, encode


@pytest.mark.parametrize(
    "news",
    [
        HeadSaved("p1", "00ff", {"id": "00ff", "links": ["a"]}, "/heads/00ff.head", "digest"),
        HeadsGone("p1", ("00ff", "11ee")),
        HeadInert("p1", "http://10.0.0.1:8080", "00ff", 3600.0, 600.0),
        SlotsErased("p1", "http://10.0.0.1:8080", True, 1_700_000_000_000_000_000),
    ],
)
def test_each_kind_reads_back_as_written(news: News) -> None:
    assert decode(encode(news)) == news


@pytest.mark.parametrize(
    "raw",
    [None, b"", b"not json", b"[]", b'{"kind": "other"}', b'{"kind": "gone"}', b'{"kind": "erased", "proxy": "p",'
     b' "server": "s", "restarted": "yes", "stamp_ns": 1}', b'{"kind": "head", "proxy": "p", "head": "h", "entry": [],'
     b' "path": "x", "tenants": "t"}'],
)  # fmt: skip
def test_what_does_not_read_as_news_is_none(raw: bytes | None) -> None:
    assert decode(raw) is None
