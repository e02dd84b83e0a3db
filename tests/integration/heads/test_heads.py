"""Warm starts on a REAL llama-server (tiny model, one slot, no RAM prompt cache, unless said): a session's first
turn leaves a head in the store, a new session's first turn gets it restored into its slot (`cache_n` says so), and
so does the first turn after the proxy is rebuilt from the same state (a restart); an idle session's state is kept
and a conversation resumed after a restart gets it back; a head of another build is not
restored; the bound evicts the least recently used head; the sweep of left-over slot files leaves heads alone; side
requests on a server of two slots leave the session's slot alone; and on the real 0.5B greedy output is the same
restored as cold."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from adaptive_spec.kv.heads.book import HeadBook
from adaptive_spec.llama.binary.which import passes_messages_slot
from adaptive_spec.policy.model import HeadsPolicy, Policy
from adaptive_spec.requests.app_keys import KV
from tests.support.heads import SYSTEM, chat, erase, messages, start_proxy, store_of
from tests.support.processes.servers import LlamaServer
from tests.support.waiting import until

pytestmark = pytest.mark.asyncio(loop_scope="function")


@pytest.fixture(scope="module")
def server(
    llama_server_binary: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LlamaServer, Path]]:
    home = tmp_path_factory.mktemp("heads")
    slots = home / "slots"
    slots.mkdir()
    args = ("-c", "8192", "--parallel", "1", "--cache-ram", "0", "--spec-type", "none", "--slot-save-path", str(slots))
    llama = LlamaServer(llama_server_binary, tiny_gguf, *args, log_dir=home)
    yield llama, home
    llama.stop()


@pytest_asyncio.fixture(loop_scope="function")
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def _head_files(home: Path, heads: str = "heads") -> list[Path]:
    return sorted((home / heads).glob("*.head"))


async def test_a_head_is_saved_and_restored_into_a_new_session_and_after_a_restart(
    server: tuple[LlamaServer, Path], client: aiohttp.ClientSession
) -> None:
    llama, home = server
    proxy = await start_proxy(llama.url, home / "slots", home / "heads")
    try:
        cold = await chat(client, proxy, "first", "Write hello.py.")
        assert cold["timings"]["cache_n"] < 10
        await store_of(proxy).settled()
        heads = store_of(proxy).describe()["heads"]
        assert len(heads) == 1, store_of(proxy).describe()
        head_tokens = heads[0]["tokens"]
        assert head_tokens >= 256 and heads[0]["save_pause_ms"] > 0  # the save paused the server: it says how long
        files = _head_files(home)
        assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600
        assert list((home / "slots").iterdir()) == []  # nothing left where llama-server (and the sweeps) look

        # A new session, same system prompt, another first message: its slot was taken meanwhile.
        await erase(client, proxy)
        warm = await chat(client, proxy, "second", "Write bye.py.")
        assert "warm: head of" in warm["record"]["reason"], warm["record"]
        assert warm["timings"]["cache_n"] > head_tokens // 2, warm
        assert store_of(proxy).describe()["counts"]["restored"] == 1
        # The router's estimate of what is prefilled counts the restore.
        assert warm["record"]["new_tokens_est"] < cold["record"]["new_tokens_est"] // 2, (warm, cold)
        async with client.get(proxy.make_url("/metrics")) as r:
            assert 'adaptive_spec_heads_total{outcome="restored"} 1.0' in await r.text()
    finally:
        await proxy.close()

    # The proxy restarts (a new app on the same state directory): the head is found again and restored whole.
    proxy = await start_proxy(llama.url, home / "slots", home / "heads")
    try:
        await erase(client, proxy)
        again = await chat(client, proxy, "third", "Write hello.py.")
        assert "warm: head of" in again["record"]["reason"], again["record"]
        assert again["timings"]["cache_n"] >= head_tokens - 1, again
        assert again["text"] == cold["text"]
        async with client.get(proxy.make_url("/adaptive/heads")) as r:
            listed = await r.json()
        assert listed["enabled"] and listed["heads"][0]["restores"] == 2 and listed["heads"][0]["tokens"] == head_tokens
    finally:
        await proxy.close()


async def test_an_idle_sessions_state_is_kept_and_the_conversation_resumed_after_a_restart_is_warm(
    server: tuple[LlamaServer, Path], client: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    llama, home = server
    heads = home / "heads-sessions"
    policy = Policy(heads=HeadsPolicy(session_idle_s=0.5))
    proxy = await start_proxy(llama.url, home / "slots", heads, policy=policy)
    try:
        await erase(client, proxy)
        first = await chat(client, proxy, "conv", "Write hello.py.", max_tokens=8)
        await store_of(proxy).settled()
        assert store_of(proxy).counts["saved"] == 1  # its first turn: the agent's head
        history = [{"role": "user", "content": "Write hello.py."}, {"role": "assistant", "content": first["text"]}]
        second = await chat(client, proxy, "conv", "Now add a docstring.", max_tokens=8, history=history)
        assert second["timings"]["cache_n"] > 0  # its own slot: a session's later turn needs no store
        # Another session's turn on the one slot before this one goes idle: its state is not the slot's any more.
        other = await chat(client, proxy, "other", "Write bye.py.", max_tokens=8)
        # The event the negative check waits for: conv's idle wait ended with its save dropped (a late timer would
        # leave the wait standing, and this check waiting).
        await until(lambda: store_of(proxy).describe()["idle_waits"] == 0, "conv's idle wait to end", 60)
        await store_of(proxy).settled()
        described = store_of(proxy).describe()
        assert described["counts"]["session_saved"] == 0 and described["counts"]["dropped"] >= 1, described

        # The conversation goes on (it prefills what the other session displaced), then stays idle: kept.
        history += [
            {"role": "user", "content": "Now add a docstring."},
            {"role": "assistant", "content": second["text"]},
        ]
        third = await chat(client, proxy, "conv", "Add a test.", max_tokens=8, history=history)
        prompt_tokens = third["timings"]["prompt_n"] + third["timings"]["cache_n"]
        await until(lambda: store_of(proxy).counts["session_saved"] == 1, "the idle session's state", 60)
        await store_of(proxy).settled()
        states = [h for h in store_of(proxy).describe()["heads"] if h["session"] == "conv"]
        assert len(states) == 1 and states[0]["tokens"] == prompt_tokens, states
        assert other["record"]["reason"]  # the other session was served meanwhile
    finally:
        await proxy.close()

    # `serve` restarts and the slot holds something else: the conversation's next turn gets its state back. Its
    # background checksum pass has reached no head yet (on a busy machine it had not reached the state, the newest,
    # and an older verified head was restored instead): the turn has its best match checked there and then.
    async def not_yet(book: HeadBook) -> None:
        del book

    monkeypatch.setattr(HeadBook, "verify", not_yet)
    proxy = await start_proxy(llama.url, home / "slots", heads, policy=policy)
    try:
        await erase(client, proxy)
        history += [{"role": "user", "content": "Add a test."}, {"role": "assistant", "content": third["text"]}]
        resumed = await chat(client, proxy, "conv", "Run it.", max_tokens=8, history=history)
        assert "warm: head of" in resumed["record"]["reason"], resumed["record"]
        assert resumed["timings"]["cache_n"] >= prompt_tokens - 1, resumed
        # Cold, the same turn prefills all of it; the greedy text is the same.
        await erase(client, proxy)
        async with client.post(
            llama.url + "/v1/chat/completions",
            json={
                "messages": [{"role": "system", "content": SYSTEM}, *history, {"role": "user", "content": "Run it."}],
                "max_tokens": 8,
                "temperature": 0,
                "cache_prompt": False,
            },
        ) as r:
            cold = await r.json()
        assert cold["choices"][0]["message"]["content"] == resumed["text"]
    finally:
        await proxy.close()


async def test_a_head_of_another_build_is_never_restored(
    server: tuple[LlamaServer, Path], client: aiohttp.ClientSession
) -> None:
    llama, home = server
    proxy = await start_proxy(llama.url, home / "slots", home / "heads-build", build="/opt/a/llama-server:1:1")
    try:
        await chat(client, proxy, "build-a", "Write hello.py.")
        await store_of(proxy).settled()
        assert len(store_of(proxy).describe()["heads"]) == 1
    finally:
        await proxy.close()
    proxy = await start_proxy(llama.url, home / "slots", home / "heads-build", build="/opt/b/llama-server:2:2")
    try:
        await erase(client, proxy)
        other = await chat(client, proxy, "build-b", "Write hello.py.")
        assert "warm:" not in other["record"]["reason"] and other["timings"]["cache_n"] < 10, other
        await store_of(proxy).settled()
        assert len(store_of(proxy).describe()["heads"]) == 2  # one per build: each restores on its own only
    finally:
        await proxy.close()


async def test_with_project_keys_a_head_is_kept_found_listed_and_deleted_within_its_keys_project_only(
    server: tuple[LlamaServer, Path], client: aiohttp.ClientSession
) -> None:
    """The scope is the project of the key the request was sent with: team-b's key on team-a's path is not warm."""
    llama, home = server
    keys = {"key-a": "team-a", "key-b": "team-b"}
    proxy = await start_proxy(llama.url, home / "slots", home / "heads-tenants", project_keys=keys, main_key="main")
    try:
        await chat(client, proxy, "tenant-a1", "Write hello.py.", project="team-a", key="key-a")
        await store_of(proxy).settled()
        await erase(client, proxy, "main")
        other = await chat(client, proxy, "tenant-b1", "Write hello.py.", project="team-a", key="key-b")
        assert "warm:" not in other["record"]["reason"] and other["timings"]["cache_n"] < 10, other
        await store_of(proxy).settled()
        await erase(client, proxy, "main")
        same = await chat(client, proxy, "tenant-a2", "Write hello.py.", key="key-a")  # no path: the key's project
        assert "warm: head of" in same["record"]["reason"], same["record"]

        listed = {key: await _listed(client, proxy, key) for key in ("key-a", "key-b", "main")}
        assert len(listed["key-a"]) == 1 and len(listed["key-b"]) == 1, listed
        (head_a,), (head_b,) = listed["key-a"], listed["key-b"]
        assert head_a != head_b and sorted(listed["main"]) == sorted([head_a, head_b])  # the main key sees all
        async with client.get(proxy.make_url("/adaptive/heads"), headers=_auth("key-a")) as r:
            tenant = await r.json()
        # A tenant sees its own heads, share and counts, nothing of the others' traffic: no saves under way, no inert
        # servers, none of team-b's counts.
        assert "directory" not in tenant  # no path of the proxy's machine
        assert sorted(tenant) == ["bytes", "counts", "enabled", "heads", "max_bytes"], tenant
        assert (tenant["counts"]["saved"], tenant["counts"]["restored"]) == (1, 1), tenant["counts"]
        async with client.get(proxy.make_url("/adaptive/heads"), headers=_auth("key-b")) as r:
            assert (await r.json())["counts"]["restored"] == 0  # team-b's own: its head was never restored
        async with client.get(proxy.make_url("/adaptive/heads"), headers=_auth("main")) as r:
            everything = await r.json()
        assert {"counts", "pending", "inert_servers"} <= set(everything) and tenant["max_bytes"] == everything[
            "max_bytes"
        ] // 3, (tenant, everything)  # three scopes (team-a, team-b, the main key's) share the bound equally
        async with client.delete(proxy.make_url(f"/adaptive/heads/{head_a}"), headers=_auth("key-b")) as r:
            assert r.status == 404  # another scope's head is not there for team-b
        async with client.delete(proxy.make_url("/adaptive/heads"), headers=_auth("key-b")) as r:
            assert r.status == 200 and (await r.json())["removed"] == 1
        assert await _listed(client, proxy, "key-a") == [head_a] and await _listed(client, proxy, "key-b") == []
    finally:
        await proxy.close()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _listed(client: aiohttp.ClientSession, proxy: TestServer, key: str) -> list[str]:
    async with client.get(proxy.make_url("/adaptive/heads"), headers=_auth(key)) as r:
        assert r.status == 200, await r.text()
        return [h["id"] for h in (await r.json())["heads"]]


async def test_sweeps_leave_heads_alone_and_delete_removes_them(
    server: tuple[LlamaServer, Path], client: aiohttp.ClientSession
) -> None:
    llama, home = server
    proxy = await start_proxy(llama.url, home / "slots", home / "heads-sweep")
    try:
        await chat(client, proxy, "sweep-1", "Explain the rules.")
        await store_of(proxy).settled()
        files = sorted((home / "heads-sweep").iterdir())
        assert files
        for path in files:  # as old as any left-over slot file the sweep removes
            os.utime(path, (1.0, 1.0))
        proxy.app[KV].sweep()
        assert sorted((home / "heads-sweep").iterdir()) == files
        async with client.delete(proxy.make_url("/adaptive/heads")) as r:
            assert r.status == 200 and (await r.json())["removed"] >= 1
        assert _head_files(home, "heads-sweep") == []
        async with client.delete(proxy.make_url("/adaptive/heads/nosuchhead")) as r:
            assert r.status == 404
    finally:
        await proxy.close()


async def test_the_bound_evicts_the_least_recently_used_head(
    server: tuple[LlamaServer, Path], client: aiohttp.ClientSession
) -> None:
    llama, home = server
    proxy = await start_proxy(llama.url, home / "slots", home / "heads-lru")
    try:  # one head's size first, to set a bound that holds one and a half
        await chat(client, proxy, "lru-0", "Summarise the rules in one line.")
        await store_of(proxy).settled()
        one = store_of(proxy).describe()["bytes"]
    finally:
        await proxy.close()
    proxy = await start_proxy(llama.url, home / "slots", home / "heads-lru", max_bytes=one * 3 // 2)
    try:
        other_system = SYSTEM.replace("Rules:", "House rules:")  # another head from the first piece on
        await chat(client, proxy, "lru-1", "Summarise the rules in one line.", system=other_system)
        await store_of(proxy).settled()
        described = store_of(proxy).describe()
        assert len(described["heads"]) == 1 and described["counts"]["evicted"] == 1, described
        assert described["bytes"] <= one * 3 // 2 and len(_head_files(home, "heads-lru")) == 1
        await erase(client, proxy)
        gone = await chat(client, proxy, "lru-2", "Summarise the rules in one line.")  # the evicted head's prompt
        assert "warm:" not in gone["record"]["reason"] and gone["timings"]["cache_n"] < 10, gone
    finally:
        await proxy.close()


async def test_side_requests_go_to_another_slot_than_their_session(
    llama_server_binary: str, tiny_gguf: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """Two slots and no RAM prompt cache: the session's second turn finds its first still in its slot."""
    args = (
        "-c",
        "16384",
        "--parallel",
        "2",
        "--cache-ram",
        "0",
        "--spec-type",
        "none",
        "--slot-save-path",
        str(tmp_path),
    )
    llama = LlamaServer(llama_server_binary, tiny_gguf, *args, log_dir=tmp_path)
    proxy = await start_proxy(llama.url, tmp_path, tmp_path / "heads")
    try:
        first = await chat(client, proxy, "main", "Write hello.py.")
        title = await chat(client, proxy, "main", "Write hello.py.", system="Write a title for this.", max_tokens=2)
        assert title["record"]["side"], title["record"]
        body_tokens = first["timings"]["prompt_n"] + first["timings"]["cache_n"]
        second = await chat(client, proxy, "main", "Write hello.py. Then bye.py.")
        assert second["timings"]["cache_n"] >= body_tokens - 16, (first["timings"], second["timings"])
    finally:
        await proxy.close()
        llama.stop()


async def test_greedy_output_is_the_same_restored_and_cold_on_the_real_model(
    llama_server_binary: str, qwen_gguf: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """The cold run prefills in the same split as the restored one (the head's turn, then the new prompt from where
    it differs): batch splits can change CPU results, the restore must not."""
    args = ("-c", "4096", "--parallel", "1", "-t", "1", "--cache-ram", "0", "--spec-type", "none")
    llama = LlamaServer(llama_server_binary, qwen_gguf, *args, "--slot-save-path", str(tmp_path), log_dir=tmp_path)
    proxy = await start_proxy(llama.url, tmp_path, tmp_path / "heads")
    try:
        head_turn = await chat(client, proxy, "a", "Write hello.py.", max_tokens=8)
        await store_of(proxy).settled()
        (head,) = (h["id"] for h in store_of(proxy).describe()["heads"])
        cold = await chat(client, proxy, "b", "Write a function that adds two numbers.", max_tokens=24)
        assert "warm:" not in cold["record"]["reason"]  # the slot held the head's turn itself: nothing to restore
        await store_of(proxy).settled()
        assert [h["id"] for h in store_of(proxy).describe()["heads"]] == [head]  # b's first message: no head of its own
        await erase(client, proxy)
        warm = await chat(client, proxy, "c", "Write a function that adds two numbers.", max_tokens=24)
        assert "warm: head of" in warm["record"]["reason"], warm["record"]
        assert warm["timings"]["cache_n"] == cold["timings"]["cache_n"], (cold["timings"], warm["timings"])
        assert warm["text"] == cold["text"] and head_turn["text"]
    finally:
        await proxy.close()
        llama.stop()


async def test_two_sessions_starting_at_once_on_two_slots_both_get_the_head(
    llama_server_binary: str, tiny_gguf: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """The second restore waits for the first (a fraction of a second) instead of prefilling, and goes into its own
    slot while the first session's slot already processes."""
    args = ("-c", "16384", "--parallel", "2", "--cache-ram", "0", "--spec-type", "none", "--slot-save-path")
    llama = LlamaServer(llama_server_binary, tiny_gguf, *args, str(tmp_path), log_dir=tmp_path)
    proxy = await start_proxy(llama.url, tmp_path, tmp_path / "heads")
    try:
        await chat(client, proxy, "first", "Write hello.py.")
        await store_of(proxy).settled()
        assert store_of(proxy).counts["saved"] == 1, store_of(proxy).describe()
        await erase(client, proxy)
        one, two = await asyncio.gather(
            chat(client, proxy, "one", "Write bye.py.", max_tokens=64),
            chat(client, proxy, "two", "Write ok.py.", max_tokens=64),
        )
        for turn in (one, two):
            assert "warm: head of" in turn["record"]["reason"], turn["record"]
            assert turn["timings"]["cache_n"] > 256, turn["timings"]
        assert store_of(proxy).counts["restored"] == 2
    finally:
        await proxy.close()
        llama.stop()


async def test_the_patched_build_runs_a_messages_request_in_the_slot_it_names(
    llama_server_binary: str, tiny_gguf: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """Patch 0006: `id_slot` passes through the Anthropic conversion. A first request naming slot 1 runs there (a
    server that drops the field puts it in slot 0, the first of two unused ones)."""
    llama = LlamaServer(llama_server_binary, tiny_gguf, "-c", "4096", "--parallel", "2", log_dir=tmp_path)
    try:
        body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}], "id_slot": 1}
        async with client.post(f"{llama.url}/v1/messages", json=body) as r:
            assert r.status == 200, await r.text()
        async with client.get(f"{llama.url}/slots") as r:
            tasks = {s["id"]: s.get("id_task") for s in await r.json()}
        assert tasks[1] is not None and tasks[0] is None, tasks
    finally:
        llama.stop()


@pytest.mark.parametrize("names_slot", [True, False], ids=["patched", "no-slot-on-messages"])
async def test_a_claude_code_session_on_two_slots_keeps_its_head_where_messages_name_their_slot(
    llama_server_binary: str, tiny_gguf: Path, tmp_path: Path, client: aiohttp.ClientSession, names_slot: bool
) -> None:
    """Claude Code's /v1/messages requests on a server of two slots: the patched build passes `id_slot` through
    (patch 0006), so its session has a slot of its own, its first turn is kept as a head and the next session starts
    warm. A server that drops the field (or one the proxy cannot tell passes it) names no slot: nothing is kept, as
    the head store cannot tell which slot the request used."""
    assert passes_messages_slot(llama_server_binary)  # the suite's server is the patched build
    args = ("-c", "16384", "--parallel", "2", "--cache-ram", "0", "--spec-type", "none", "--slot-save-path")
    llama = LlamaServer(llama_server_binary, tiny_gguf, *args, str(tmp_path), log_dir=tmp_path)
    proxy = await start_proxy(llama.url, tmp_path, tmp_path / "heads", messages_slot=names_slot)
    try:
        first = await messages(client, proxy, "cc-first", "Write hello.py.")
        assert first["record"]["status"] == 200
        await store_of(proxy).settled()
        assert store_of(proxy).counts["saved"] == (1 if names_slot else 0), store_of(proxy).describe()
        await erase(client, proxy)
        second = await messages(client, proxy, "cc-second", "Write bye.py.")
        warm = "warm: head of" in second["record"]["reason"]
        assert warm == names_slot, second["record"]
        if names_slot:
            assert second["record"]["timings"]["cache_n"] > 256, second["record"]["timings"]
    finally:
        await proxy.close()
        llama.stop()


def _holds(path: Path, tokens: list[int]) -> bool:
    """Whether a llama-server slot file holds this run of tokens (stored as 32-bit little-endian ids)."""
    return b"".join(t.to_bytes(4, "little", signed=True) for t in tokens) in path.read_bytes()


async def _prompt_tokens(client: aiohttp.ClientSession, llama: LlamaServer, system: str, user: str) -> list[int]:
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    async with client.post(llama.url + "/apply-template", json=body) as r:
        prompt = (await r.json())["prompt"]
    async with client.post(llama.url + "/tokenize", json={"content": prompt, "add_special": True}) as r:
        return list((await r.json())["tokens"])


async def test_a_head_never_holds_another_tenants_tokens_when_its_request_comes_the_moment_the_turn_ends(
    server: tuple[LlamaServer, Path], client: aiohttp.ClientSession
) -> None:
    """One slot, two tenants: B's request is sent the moment A's first turn is answered, round after round. A save
    that lost the race to B's request is dropped, never kept with B's KV under A's key: every head A's scope keeps
    holds A's own tokens, and A's restores reuse no more than A's own prompt."""
    llama, home = server
    keys = {"key-a": "team-a", "key-b": "team-b"}
    proxy = await start_proxy(llama.url, home / "slots", home / "heads-race", project_keys=keys, main_key="main")
    try:
        own: dict[str, list[int]] = {}
        for n in range(8):
            system_a = SYSTEM.replace("Rules:", f"Rules of team A, round {n}:")
            system_b = SYSTEM.replace("Rules:", f"Rules of team B, round {n}:")  # as long: the token window is no guard
            await chat(client, proxy, f"a{n}", "Write hello.py.", system=system_a, key="key-a")
            if n % 2:  # every other round B comes once A's save is over: those heads are kept
                await store_of(proxy).settled()
            await chat(client, proxy, f"b{n}", "Write hello.py.", system=system_b, key="key-b")  # else at once
            await store_of(proxy).settled()
            own[system_a] = await _prompt_tokens(client, llama, system_a, "Write hello.py.")
        store = store_of(proxy)
        heads_a = [e for e in store.book.heads() if e.scope == "team-a"]
        # The rounds where B waited keep A's head, checked below (under load a save can lose one of those too; and
        # a race round's save is dropped, fails safe, or, when it won the race, holds A's own tokens).
        assert len(heads_a) >= 1, store.counts
        theirs = [await _prompt_tokens(client, llama, s.replace("team A", "team B"), "Write hello.py.") for s in own]
        for entry in heads_a:  # the first 200 tokens hold the round's "team A" or "team B"
            path = store.book.path(entry.id)
            assert any(_holds(path, tokens[:200]) for tokens in own.values()), entry.id
            assert not any(_holds(path, tokens[:200]) for tokens in theirs), entry.id
        # A's restores reuse at most what A's own prompt shares with a head of A's.
        for n, system_a in enumerate(own):
            await erase(client, proxy, "main")
            again = await chat(client, proxy, f"a-again{n}", "Write hello.py.", system=system_a, key="key-a")
            assert again["timings"]["cache_n"] <= len(own[system_a]), again["timings"]
    finally:
        await proxy.close()
