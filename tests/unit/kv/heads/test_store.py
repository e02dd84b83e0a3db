"""The head store's pure part (keys, chains, matching, eviction, pricing) and the store's own learning: a head of
another model or template is never matched, and an inert restore is not tried again on that server."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from adaptive_spec.kv.costs import PrefillRate
from adaptive_spec.kv.heads.activity import Counted, TurnMark
from adaptive_spec.kv.heads.matching import (
    NO_TENANT,
    HeadEntry,
    Match,
    ServerKey,
    best_match,
    chain,
    covered,
    covered_but_last,
    earlier_states,
    evictions,
    inert,
    price,
    tenant_scope,
)
from adaptive_spec.kv.heads.store import HeadStore
from adaptive_spec.kv.heads.values import HeadsConfig, Restored, SavedTurn
from adaptive_spec.kv.moves import AfterTurn, HeadSave, SlotAt
from adaptive_spec.llama.upstreams import Upstream
from tests.support.heads import restore

KEY = ServerKey("/models/qwen.gguf", 491_400_064, 8192, "t1")
PIECES = [b"system", b"tools", b"user-1"]


def _entry(links: tuple[str, ...], tokens: int = 1000, size: int = 100, used: float = 0.0) -> HeadEntry:
    return HeadEntry(links[-1][:24], links, (400, 500, 100)[: len(links)], tokens, tokens + 4, size, used, used)


def test_a_new_prompt_finds_the_longest_stored_prefix_without_its_text() -> None:
    head = _entry(chain(KEY, PIECES))
    whole = best_match(chain(KEY, PIECES), [head])
    assert whole is not None and (whole.pieces, whole.tokens) == (3, 1000)
    other_user = best_match(chain(KEY, [b"system", b"tools", b"user-2"]), [head])
    assert other_user is not None and (other_user.pieces, other_user.tokens) == (2, 900)
    assert best_match(chain(KEY, [b"another system"]), [head]) is None
    assert covered(chain(KEY, PIECES[:2]), [head]) and not covered(chain(KEY, [*PIECES, b"more"]), [head])


@pytest.mark.parametrize(
    "other",
    [
        ServerKey("/models/other.gguf", 491_400_064, 8192, "t1"),  # another model
        ServerKey("/models/qwen.gguf", 1, 8192, "t1"),  # the same path, another file
        ServerKey("/models/qwen.gguf", 491_400_064, 4096, "t1"),  # another context
        ServerKey("/models/qwen.gguf", 491_400_064, 8192, "t2"),  # another chat template
        ServerKey("/models/qwen.gguf", 491_400_064, 8192, "t1", model_sample="rewritten"),  # the file re-made
        ServerKey("/models/qwen.gguf", 491_400_064, 8192, "t1", build="/opt/llama-server:2:3|b0-unknown"),  # build
        ServerKey("/models/qwen.gguf", 491_400_064, 8192, "t1", cache_type_k="q8_0"),  # another K cache type
        ServerKey("/models/qwen.gguf", 491_400_064, 8192, "t1", cache_type_v="q8_0"),  # another V cache type
    ],
)
def test_a_head_of_another_model_context_or_template_is_never_matched(other: ServerKey) -> None:
    assert best_match(chain(other, PIECES), [_entry(chain(KEY, PIECES))]) is None


def test_another_first_message_after_a_kept_head_makes_no_head_of_its_own() -> None:
    head = _entry(chain(KEY, PIECES))  # system, tools, user-1: 400, 500 and 100 characters
    other_user = chain(KEY, [b"system", b"tools", b"user-2"])
    assert covered_but_last(other_user, (400, 500, 10), [head])  # a short first message: the head is enough
    assert not covered_but_last(other_user, (400, 500, 300), [head])  # a long one (a pasted file) is its own head
    assert not covered_but_last(chain(KEY, [b"other system", b"tools", b"user-2"]), (400, 500, 10), [head])


def test_with_projects_as_tenants_a_head_is_matched_within_its_project_only() -> None:
    team_a = _entry(chain(KEY, PIECES, scope="team-a"))
    assert best_match(chain(KEY, PIECES, scope="team-b"), [team_a]) is None
    assert best_match(chain(KEY, PIECES), [team_a]) is None
    assert best_match(chain(KEY, PIECES, scope="team-a"), [team_a]) is not None


def test_the_tenant_scope_is_the_project_of_the_key_sent_never_of_the_path() -> None:
    keys = {"key-a": "team-a", "key-b": "team-b"}
    assert tenant_scope(["key-b"], keys) == "team-b"  # whatever /p/<project> the request names
    assert tenant_scope(["main-key"], keys) == tenant_scope([], keys) == NO_TENANT  # the main key, or none
    assert NO_TENANT not in keys.values() and chain(KEY, PIECES, NO_TENANT) != chain(KEY, PIECES)
    assert tenant_scope(["key-a"], {}) == tenant_scope([], {}) == ""  # no project keys: heads are shared


def test_a_launched_servers_key_names_its_k_and_v_cache_types(tmp_path: Path) -> None:
    from adaptive_spec.kv.heads.options import launched_heads

    config = HeadsConfig(None)
    binary = tmp_path / "llama-server"
    binary.write_text("")
    launched = launched_heads(config, tmp_path, str(binary), ["-ctk", "q8_0", "--cache-type-v", "q4_0"], {"k": "p"})
    assert launched.cache_types == ("q8_0", "q4_0") and launched.project_keys == {"k": "p"}
    assert launched_heads(config, tmp_path, str(binary)).cache_types == ("f16", "f16")
    assert launched_heads(config, tmp_path, None).cache_types == ("", "")  # attached: /props does not say


def test_the_least_recently_used_heads_go_first_until_the_store_fits() -> None:
    old, mid, new = (_entry(chain(KEY, [bytes([i])]), size=100, used=float(i)) for i in range(3))
    assert evictions([new, old, mid], max_bytes=300) == []
    assert evictions([new, old, mid], max_bytes=250) == [old.id]
    assert evictions([new, old, mid], max_bytes=150, incoming_bytes=50) == [old.id, mid.id]


def test_a_restore_pays_only_when_it_beats_prefilling_what_the_slot_lacks() -> None:
    match = Match(_entry(chain(KEY, PIECES), tokens=7200, size=88_000_000), 3, 7200)
    slow_cpu = price(match, slot_tokens=0, prefill=PrefillRate(1 / 60), restore_bytes_per_s=400e6)
    assert slow_cpu.pays and slow_cpu.restore_s < 0.5 < 100 < slow_cpu.prefill_s
    assert not price(match, slot_tokens=7180, prefill=PrefillRate(1 / 60), restore_bytes_per_s=400e6).pays
    fast_gpu = price(match, slot_tokens=0, prefill=PrefillRate(1 / 50_000), restore_bytes_per_s=400e6)
    assert not fast_gpu.pays  # 0.14 s of prefill against 0.27 s of reading


def test_an_index_entry_round_trips_and_a_damaged_one_is_dropped() -> None:
    entry = _entry(chain(KEY, PIECES))
    assert HeadEntry.from_json(entry.to_json()) == entry
    assert HeadEntry.from_json({"id": "x"}) is None
    assert HeadEntry.from_json({**entry.to_json(), "id": "../etc"}) is None


@pytest.mark.asyncio(loop_scope="function")
async def test_an_inert_restore_is_learned_and_not_tried_again_on_that_server(tmp_path: Path) -> None:
    async with aiohttp.ClientSession() as client:
        store = HeadStore(HeadsConfig(tmp_path / "heads"), tmp_path / "slots", lambda: client)
        upstream = Upstream("p", "http://127.0.0.1:9")  # nothing listens: any HTTP would fail the restore loudly
        for n in (1, 2):  # the server reported cache_n 0 for two heads in a row (one may be a lost race for the slot)
            restored = Restored(f"abc{n}", upstream.base_url, tokens=7000, restore_ms=20.0, forwards=n - 1)
            store.forwarded(upstream)  # the request the head was restored for, and no other
            store.after_turn(upstream, AfterTurn("", 0, restored, 0, inert(restored.tokens, 0)))
            assert store.describe()["inert_servers"] == ([upstream.base_url] if n == 2 else [])
        assert store.counts["inert"] == 2
        assert await restore(store, upstream, 0, PIECES) is None
        assert store.counts["failed"] == 0  # refused before asking the server anything


@pytest.mark.asyncio(loop_scope="function")
async def test_a_restore_whose_slot_another_request_took_is_not_judged_inert(tmp_path: Path) -> None:
    async with aiohttp.ClientSession() as client:
        store = HeadStore(HeadsConfig(tmp_path / "heads"), tmp_path / "slots", lambda: client)
        upstream = Upstream("p", "http://127.0.0.1:9")
        restored = Restored("abc", upstream.base_url, tokens=7000, restore_ms=20.0, forwards=0)
        store.forwarded(upstream)  # another session's request took the slot after the restore
        store.forwarded(upstream)  # then the request the head was restored for: it re-prefilled
        store.after_turn(upstream, AfterTurn("", 0, restored, 0, inert(restored.tokens, 0)))
        assert store.describe()["inert_servers"] == [] and store.counts == {**store.counts, "inert": 0, "taken": 1}


def test_an_unusable_heads_directory_costs_the_warm_starts_not_the_proxy(tmp_path: Path) -> None:
    from adaptive_spec.llama.upstreams import UpstreamTable
    from adaptive_spec.proxy.app import KvSetup, ProxySettings, build_app
    from adaptive_spec.requests.heads import HEADS

    (tmp_path / "not-a-dir").write_text("")
    kv = KvSetup(slot_dir=tmp_path, heads=HeadsConfig(tmp_path / "not-a-dir" / "heads"))
    app = build_app(UpstreamTable([Upstream("p", "http://127.0.0.1:9")]), ProxySettings(), kv=kv)
    assert app.get(HEADS) is None


def test_the_heads_policy_keys_load_and_a_misspelt_one_names_file_key_and_line() -> None:
    from adaptive_spec.policy.reading import PolicyError, load_policy

    policy = load_policy([("p.toml", "[heads]\nenabled = false\nmin_tokens = 1024\n")])
    assert (policy.heads.enabled, policy.heads.min_tokens) == (False, 1024)
    with pytest.raises(PolicyError) as caught:
        load_policy([("p.toml", "[heads]\nenabled = true\nmin_tokns = 3\nmin_tokens = -1\n")])
    problems = str(caught.value)
    assert "p.toml:heads.min_tokns:3:" in problems and "min_tokens" in problems.split("\n")[0]
    assert "p.toml:heads.min_tokens:4:" in problems


def test_only_the_newest_state_of_a_session_is_kept() -> None:
    head = _entry(chain(KEY, PIECES[:2]))
    older = replace(_entry(chain(KEY, PIECES)), session="s1")
    newer = replace(_entry(chain(KEY, [*PIECES, b"reply", b"user-2"])), chars=(400, 500, 100, 80, 20), session="s1")
    other = replace(_entry(chain(KEY, [b"x", b"y"])), session="s2")
    # Another run's session numbered s1 too (its own conversation), and another tenant's s1: both stay.
    another_run = replace(_entry(chain(KEY, [b"z", b"w"])), session="s1")
    another_tenant = replace(_entry(chain(KEY, PIECES, "team-b")), session="s1", scope="team-b")
    entries = [head, older, newer, other, another_run, another_tenant]
    assert earlier_states(entries, newer) == [older.id]
    assert earlier_states(entries, replace(newer, session="")) == []  # heads are not a session's
    assert HeadEntry.from_json(newer.to_json()) == newer and newer.describe()["session"] == "s1"


@pytest.mark.asyncio(loop_scope="function")
async def test_a_restore_is_tried_on_a_sessions_first_request_and_its_first_after_its_server_restarted(
    tmp_path: Path,
) -> None:
    async with aiohttp.ClientSession() as client:
        store = HeadStore(HeadsConfig(tmp_path / "heads"), tmp_path / "slots", lambda: client)
        one, two = Upstream("p", "http://127.0.0.1:9"), Upstream("q", "http://127.0.0.1:10")
        assert store.arriving("s", one) and not store.arriving("s", one)
        store.server_down(two)
        assert not store.arriving("s", one)  # another server's restart: its slot still holds its KV
        store.server_down(one)
        assert store.arriving("s", one) and not store.arriving("s", one)
        assert not store.arriving(None, one)
        # Another tenant's session of the same name is another session: its first request is its own.
        assert store.arriving("s", one, "tenant-b") and not store.arriving("s", one, "tenant-b")


async def _turn(
    store: HeadStore,
    upstream: Upstream,
    session: str,
    idle_s: float,
    first: bool = False,
    mark: TurnMark | None = None,
) -> None:
    """A turn of `session` served, as the router's `plan_save` asks the store to keep it: a first turn's head at once,
    a later turn's state once the session is idle `idle_s` (0: not kept)."""
    turn = SavedTurn(tuple(PIECES), (400, 500, 100), 1000, 8, "agent", "p", "")
    at = SlotAt(upstream.name, upstream.replica, None)
    save = None
    if first:
        save = HeadSave(at, upstream.base_url, turn, mark)
    elif idle_s > 0:
        save = HeadSave(at, upstream.base_url, replace(turn, session=session), mark, idle_s)
    store.after_turn(upstream, AfterTurn("", 0, session=session, save=save))


async def _decided(store: HeadStore, **counts: int) -> None:
    """Wait until no idle wait is left and the store's counts say `counts`: the event a negative check waits for is
    the wait's own end (a save tried, or dropped), so a late timer cannot pass it."""
    for _ in range(2000):
        await store.settled()
        if store.describe()["idle_waits"] == 0 and all(store.counts[k] == v for k, v in counts.items()):
            return
        await asyncio.sleep(0.005)
    raise AssertionError((store.describe()["idle_waits"], store.counts))


@pytest.mark.asyncio(loop_scope="function")
async def test_an_idle_sessions_state_is_saved_once_and_only_if_its_slot_served_nothing_else(tmp_path: Path) -> None:
    # Nothing listens at the upstream: a save that is tried fails on its first question (/props), and is counted.
    async with aiohttp.ClientSession() as client:
        store = HeadStore(HeadsConfig(tmp_path / "heads"), tmp_path / "slots", lambda: client)
        upstream = Upstream("p", "http://127.0.0.1:9")
        await _turn(store, upstream, "s", idle_s=0.05)
        await _turn(store, upstream, "s", idle_s=0.05)  # a newer turn: the older one's wait is dropped
        assert store.describe()["idle_waits"] == 1
        await _decided(store, failed=1, dropped=0)  # one save tried, for the newest turn

        await _turn(store, upstream, "t", idle_s=0.05)
        store.forwarded(upstream)  # another request used the one slot: it holds another prompt now
        await _decided(store, failed=1, dropped=1)  # its wait ended, and the save was not tried

        await _turn(store, upstream, "u", idle_s=0.05)
        store.server_down(upstream)  # the server restarted: its slots hold nothing of the session
        assert store.describe()["idle_waits"] == 0  # its wait is gone: nothing is left to be tried
        await _turn(store, upstream, "v", idle_s=0.0)  # sessions are not kept with 0
        assert store.describe()["idle_waits"] == 0
        await _turn(store, upstream, "w", idle_s=0.05, first=True)  # a first turn is a head, saved at once
        assert store.describe()["idle_waits"] == 0
        await _decided(store, failed=2, dropped=1)  # the head's save, tried at once
        await store.close()


@pytest.mark.asyncio(loop_scope="function")
async def test_a_request_forwarded_while_a_turn_ran_keeps_that_turn_from_being_saved(tmp_path: Path) -> None:
    """One slot: a request sent while the session's turn was still generating runs after it, in the same slot."""
    async with aiohttp.ClientSession() as client:
        store = HeadStore(HeadsConfig(tmp_path / "heads"), tmp_path / "slots", lambda: client)
        upstream = Upstream("p", "http://127.0.0.1:9")  # a save that is tried fails at once, and is counted
        store.forwarded(upstream, None, "turn")
        store.forwarded(upstream, None, "other")  # queued behind the turn by llama-server
        await _turn(store, upstream, "s", idle_s=0.05, mark=store.ended("turn").mark)
        await _decided(store, failed=0, dropped=1)  # not tried: the slot holds the other prompt
        store.forwarded(upstream, None, "next")
        await _turn(store, upstream, "s", idle_s=0.05, mark=store.ended("next").mark)
        await _decided(store, failed=1, dropped=1)  # nothing after it: tried
        await store.close()


@pytest.mark.asyncio(loop_scope="function")
async def test_a_kv_move_into_a_slot_counts_as_its_use_and_holds_the_stores_lock(tmp_path: Path) -> None:
    """A handoff's restore fills the slot a session's turn left: that turn's state is not saved after it, and no
    save or restore of a head runs while the move does."""
    async with aiohttp.ClientSession() as client:
        store = HeadStore(HeadsConfig(tmp_path / "heads"), tmp_path / "slots", lambda: client)
        upstream = Upstream("p", "http://127.0.0.1:9")
        store.forwarded(upstream, None, "turn")
        mark = store.ended("turn").mark
        async with store.moving(upstream, None):
            assert store._lock.locked()  # a save or restore waits for the move
        await _turn(store, upstream, "s", idle_s=0.05, mark=mark)
        await _decided(store, failed=0, dropped=1)  # not tried: the slot holds the moved KV
        async with store.moving(upstream, None, locked=False):  # a remote prefill's: counted, not locked
            assert not store._lock.locked()
        await store.close()


class _Shared:
    """The forward counts all proxies keep, as `SharedForwards` gives them: the bookings' marks by request."""

    def __init__(self) -> None:
        self.marks: dict[str, Counted] = {}

    def booked(self, request_id: str) -> Counted | None:
        return self.marks.pop(request_id, None)

    async def read(self, server: str, slot: int | None) -> Counted | None:
        return None


@pytest.mark.asyncio(loop_scope="function")
async def test_with_shared_counts_a_restore_is_judged_inert_only_if_no_other_proxys_request_came(
    tmp_path: Path,
) -> None:
    """Another proxy's request took the slot between the restore and its request: this proxy's own counts saw only
    its request (so alone they would blame the head), the shared counts one more booking since that request's."""
    async with aiohttp.ClientSession() as client:
        shared = _Shared()
        store = HeadStore(HeadsConfig(tmp_path / "heads"), tmp_path / "slots", lambda: client, shared=shared)
        upstream = Upstream("p", "http://127.0.0.1:9")
        for n, after in enumerate((Counted("e", 2, 0, 0, 2), Counted("e", 1, 0, 0, 1)), start=1):
            shared.marks[f"r{n}"] = Counted("e", 1, 0, 0, 1)  # the request's own booking
            restored = Restored(f"abc{n}", upstream.base_url, 7000, 20.0, forwards=n - 1, counted=after)
            store.forwarded(upstream, 0, f"r{n}")
            mark = store.ended(f"r{n}").mark
            store.after_turn(upstream, AfterTurn("", 0, restored, 0, inert(restored.tokens, 0), mark=mark))
        assert store.counts == {**store.counts, "taken": 1, "inert": 1}  # the first came after another's booking
        assert store.describe()["inert_servers"] == []  # one head in a row only: the first is not held against it
        # A restore whose counts could not be read is never blamed on the head.
        store.forwarded(upstream, 0, "r3")
        restored = Restored("abc3", upstream.base_url, 7000, 20.0, forwards=2)
        mark = store.ended("r3").mark
        store.after_turn(upstream, AfterTurn("", 0, restored, 0, inert(restored.tokens, 0), mark=mark))
        assert store.counts == {**store.counts, "taken": 2, "inert": 1}
        await store.close()
