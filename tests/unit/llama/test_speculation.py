"""Profiles as per-request settings of one llama-server, the pure parts: which launched profiles one server can host,
what each profile's requests carry and may draft with, how a patched server is told from a stock one (recorded
/props of each), the `--profile` suffix, and which attached profiles share a server."""

from __future__ import annotations

from typing import Any

import pytest

from adaptive_spec.errors import ConfigError
from adaptive_spec.llama.placement import ONE_SERVER, first_servers, startup_lines
from adaptive_spec.llama.profiles import (
    AttachedProfile,
    NgramModParams,
    ProfileInfo,
    ProfileSpec,
    default_profiles,
    one_server,
    shared_servers,
    speculation_problem,
)
from adaptive_spec.llama.speculation import PerRequestSupport, Speculation, merge_fields
from tests.support.recorded import recorded

NGRAM = NgramModParams(24, 48, 64)


@pytest.mark.parametrize(
    ("draft_type", "server_types", "oneshot"),
    [
        (None, ("ngram-mod",), ()),
        ("dflash", ("draft-dflash", "ngram-mod"), ("draft-dflash",)),
        ("simple", ("draft-simple", "ngram-mod"), ("draft-simple",)),
        ("eagle3", ("draft-eagle3", "ngram-mod"), ("draft-eagle3",)),
        ("mtp", ("draft-mtp", "ngram-mod"), ("draft-mtp",)),
    ],
)
def test_the_default_pair_is_one_server_with_oneshot_restricted(
    draft_type: str | None, server_types: tuple[str, ...], oneshot: tuple[str, ...]
) -> None:
    specs = default_profiles(draft_type, NGRAM)
    sharing = one_server(specs)
    assert sharing is not None and sharing.host == "iterative"
    host = next(s for s in specs if s.name == sharing.host)
    assert host.spec_types == server_types  # the server is iterative's own: a stock fallback keeps it as it is
    assert sharing.speculation("oneshot") == Speculation(types=oneshot)
    assert sharing.speculation("iterative") == Speculation()  # names nothing: the server's own behaviour
    assert [s.name for s in first_servers(specs, shared=True)] == ["iterative"]
    assert [s.name for s in first_servers(specs, shared=False)] == ["oneshot", "iterative"]


@pytest.mark.parametrize(
    "specs",
    [
        # Neither server's types hold the other's.
        (ProfileSpec("a", ("draft-dflash",)), ProfileSpec("b", ("ngram-mod",))),
        # ngram-mod is tuned differently in each: one server cannot be both.
        (ProfileSpec("a", ("ngram-mod",), NgramModParams(8, 8, 16)), ProfileSpec("b", ("ngram-mod",), NGRAM)),
    ],
)
def test_profiles_one_server_cannot_host_get_one_each(specs: tuple[ProfileSpec, ...]) -> None:
    assert one_server(specs) is None
    assert [s.name for s in first_servers(specs, shared=True)] == ["a", "b"]


@pytest.mark.parametrize(
    ("settings", "server", "drafts"),
    [
        (Speculation(), ("none", "draft-dflash", "ngram-mod"), ("draft-dflash", "ngram-mod")),
        (Speculation(types=()), ("ngram-mod",), ("none",)),
        (Speculation(types=("draft-dflash",)), ("draft-dflash", "ngram-mod"), ("draft-dflash",)),
        (Speculation(n_max=0), ("draft-dflash", "ngram-mod"), ("none",)),
        (Speculation(n_max=4), ("ngram-mod",), ("ngram-mod",)),
    ],
)
def test_what_a_profile_drafts_with(settings: Speculation, server: tuple[str, ...], drafts: tuple[str, ...]) -> None:
    assert settings.drafting_types(server) == drafts


@pytest.mark.parametrize(
    ("settings", "fields", "described"),
    [
        (Speculation(), {}, "the server's own"),
        (Speculation(types=()), {"speculative.types": []}, "types=none"),
        (
            Speculation(types=("draft-dflash",), n_max=8),
            {"speculative.types": ["draft-dflash"], "speculative.n_max": 8},
            "types=draft-dflash n_max=8",
        ),
    ],
)
def test_the_fields_a_profile_sends(settings: Speculation, fields: dict[str, Any], described: str) -> None:
    assert settings.body_fields() == fields
    assert settings.describe() == described


@pytest.mark.parametrize(
    ("text", "profile"),
    [
        ("a=http://h:8080", AttachedProfile("a", "http://h:8080")),
        ("a=http://h:8080;types=none", AttachedProfile("a", "http://h:8080", speculation=Speculation(types=()))),
        ("a=http://h:8080/;types=", AttachedProfile("a", "http://h:8080", speculation=Speculation(types=()))),
        (
            "a=http://h:8080#m;types=draft-dflash,ngram-mod;n_max=4",
            AttachedProfile("a", "http://h:8080", "m", Speculation(("draft-dflash", "ngram-mod"), 4)),
        ),
        ("a=http://h:8080;n_max=0", AttachedProfile("a", "http://h:8080", speculation=Speculation(n_max=0))),
    ],
)
def test_the_profile_suffix(text: str, profile: AttachedProfile) -> None:
    assert AttachedProfile.parse(text) == profile


@pytest.mark.parametrize("text", ["a=http://h:8080;n_max=-1", "a=http://h:8080;kinds=x", "a=http://h:8080;types"])
def test_a_bad_suffix_names_what_it_takes(text: str) -> None:
    with pytest.raises(ConfigError, match=r"is not types=T1,T2 \(or none\) or n_max=N"):
        AttachedProfile.parse(text)


def _props(name: str) -> dict[str, Any]:
    props: dict[str, Any] = recorded(f"props_{name}")
    return props


def test_a_patched_server_says_so_in_props_and_a_stock_one_does_not() -> None:
    assert PerRequestSupport.from_props(_props("patched")) == PerRequestSupport(("ngram-mod",), 64)
    assert PerRequestSupport.from_props(_props("stock")) is None


@pytest.mark.parametrize(
    "field",
    [None, [], {"types": "ngram-mod", "n_max": 64}, {"types": ["ngram-mod"]}, {"types": [], "n_max": True}],
)
def test_a_props_field_that_cannot_be_read_counts_as_stock(field: Any) -> None:
    assert PerRequestSupport.from_props({"speculative_per_request": field}) is None


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        (Speculation(types=("ngram-mod",), n_max=64), None),
        (Speculation(types=()), None),
        (
            Speculation(types=("draft-dflash",)),
            "speculation type draft-dflash is not one the server was started with (ngram-mod)",
        ),
        (Speculation(n_max=65), "n_max=65 is outside the server's 0..64"),
    ],
)
def test_settings_a_server_cannot_take(settings: Speculation, problem: str | None) -> None:
    assert PerRequestSupport(("ngram-mod",), 64).problem(settings) == problem


@pytest.mark.parametrize(
    ("body", "settings", "added", "record"),
    [
        ({"messages": []}, Speculation(), {}, None),
        (
            {"messages": []},
            Speculation(types=()),
            {"speculative.types": []},
            {"types": [], "n_max": None, "set_by": "profile"},
        ),
        # The client's own field wins (it asked by name), and its record says who set it.
        (
            {"speculative.types": ["ngram-mod"]},
            Speculation(types=()),
            {},
            {"types": ["ngram-mod"], "n_max": None, "set_by": "client"},
        ),
        (
            {"speculative.n_max": 4},
            Speculation(types=()),
            {"speculative.types": []},
            {"types": [], "n_max": 4, "set_by": "profile+client"},
        ),
    ],
)
def test_merging_a_profiles_fields_into_a_request(
    body: dict[str, Any], settings: Speculation, added: dict[str, Any], record: dict[str, Any] | None
) -> None:
    fields, recorded = merge_fields(body, settings)
    assert fields == added
    assert recorded == record


def _info(name: str, url: str, patched: bool, replica: int = 0, **kw: Any) -> ProfileInfo:
    return ProfileInfo(
        name=name,
        base_url=url,
        upstream_model=kw.pop("upstream_model", None),
        model_path="/m/t.gguf",
        model_alias="",
        n_ctx=4096,
        total_slots=1,
        spec_types=("ngram-mod",),
        speculative=True,
        replica=replica,
        per_request=PerRequestSupport(("ngram-mod",), 64) if patched else None,
        **kw,
    )


def test_attached_profiles_naming_one_patched_server_share_it() -> None:
    infos = [
        _info("oneshot", "http://a:1", True, speculation=Speculation(types=())),
        _info("iterative", "http://a:1", True),
        _info("plain", "http://b:1", False),  # stock: two profiles at one URL keep today's meaning
        _info("other", "http://b:1", False),
        _info("p1", "http://c:1", True, upstream_model="x"),  # router presets: each its own process
        _info("p2", "http://c:1", True, upstream_model="y"),
    ]
    servers = shared_servers(infos)
    assert servers == {("oneshot", 0): "http://a:1", ("iterative", 0): "http://a:1"}
    assert startup_lines(infos, servers, None)[-1] == f"  oneshot, iterative: {ONE_SERVER} at http://a:1"
    assert "per-request: types=none" in startup_lines(infos, servers, None)[1]
    assert "per-request" not in startup_lines(infos, servers, None)[3]  # a stock server's line is as before


def test_settings_for_a_stock_server_or_outside_the_servers_are_refused() -> None:
    stock = _info("oneshot", "http://b:1", False, speculation=Speculation(types=()))
    assert "does not take them per request (a stock llama-server)" in (speculation_problem([stock]) or "")
    wrong = _info("oneshot", "http://a:1", True, speculation=Speculation(types=("draft-dflash",)))
    assert speculation_problem([wrong]) == (
        "profile 'oneshot' at http://a:1: speculation type draft-dflash is not one the server was started with "
        "(ngram-mod)"
    )
    assert speculation_problem([_info("iterative", "http://a:1", True)]) is None
