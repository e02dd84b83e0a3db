"""Warm-start tests' shared parts: the proxy built in-process around one llama-server with a head store, an agent's
first turn through it (its answer, timings and record), a system prompt long enough to be kept as a head, and a
restore asked of the store directly, as a route asks it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from adaptive_spec.access.rules import AccessPolicy
from adaptive_spec.common.headers import REQUEST_ID_HEADER
from adaptive_spec.kv.costs import PrefillRate
from adaptive_spec.kv.heads.choice import choose_head
from adaptive_spec.kv.heads.store import HeadStore
from adaptive_spec.kv.heads.values import HeadsConfig, Restored
from adaptive_spec.kv.moves import SlotAt
from adaptive_spec.llama.probe import probe
from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.policy.model import Policy
from adaptive_spec.proxy.app import KvSetup, ProxySettings, build_app
from adaptive_spec.requests.heads import HEADS
from adaptive_spec.routing.contract import FixedPolicy
from adaptive_spec.sessions.ngram_replay import NgramParams
from adaptive_spec.sessions.service import SessionService
from adaptive_spec.sessions.statistics import ContextTracker
from tests.support.processes.servers import free_port

SYSTEM = "You are a coding agent. Rules:\n" + "\n".join(
    f"{i}. Keep function_{i} small, typed and tested; never edit file_{i}.py without reading it." for i in range(40)
)


async def start_proxy(
    url: str,
    slots: Path,
    heads: Path,
    max_bytes: int = 2**31,
    build: str = "",
    project_keys: dict[str, str] | None = None,
    main_key: str | None = None,
    policy: Policy | None = None,
    messages_slot: bool = False,
) -> TestServer:
    """The proxy in front of the llama-server at `url` (one profile "p", its slots as `serve` probes them), its
    head store in `heads`; with `project_keys` (and `main_key`) as `serve --project-key` (`--api-key`) sets them,
    and `policy` for every project; `messages_slot`: its server passes `id_slot` through `/v1/messages`, as `serve`
    says of the patched build."""
    keys = dict(project_keys or {})
    kv = KvSetup(slot_dir=slots, heads=HeadsConfig(heads, max_bytes, build=build, project_keys=keys))
    sessions = SessionService(ContextTracker(NgramParams()), None, key_projects=keys)
    access = AccessPolicy(api_keys=(main_key, *keys)) if main_key else None
    upstream = Upstream("p", url, messages_slot=messages_slot)
    async with aiohttp.ClientSession() as client:
        info = await probe(client, upstream)
    policies = FixedPolicy(policy) if policy is not None else None
    app = build_app(
        UpstreamTable([upstream]), ProxySettings(), sessions, kv=kv, profiles=[info], access=access, policies=policies
    )
    proxy = TestServer(app, port=free_port())
    await proxy.start_server()
    return proxy


def store_of(proxy: TestServer) -> HeadStore:
    return proxy.app[HEADS]


async def restore(
    store: HeadStore, upstream: Upstream, slot: int | None, pieces: Sequence[bytes], slot_tokens: int = 0
) -> Restored | None:
    """A new session's first request on `upstream`, as a route asks the store: its view of the server, the head the
    router would choose (`choose_head`, a prefill of one token a second: any head pays), carried out."""
    view = await store.view(upstream, uuid.uuid4().hex)
    if view is None:
        return None
    move = choose_head(view, pieces, (), SlotAt(upstream.name, upstream.replica, slot), slot_tokens, PrefillRate(1.0))
    return await store.restore(upstream, move) if move is not None else None


async def chat(
    client: aiohttp.ClientSession,
    proxy: TestServer,
    session: str,
    user: str,
    system: str = SYSTEM,
    max_tokens: int = 4,
    project: str | None = None,
    key: str | None = None,
    history: Sequence[dict[str, str]] = (),
) -> dict[str, Any]:
    """One greedy chat turn as a session's request (sent with API key `key`), after the conversation's `history`
    (its earlier user and assistant messages): {"text", "timings", "record"}."""
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": system}, *history, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    path = f"/p/{project}/v1/chat/completions" if project else "/v1/chat/completions"
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    async with client.post(proxy.make_url(path), json=body, headers={"x-session-id": session, **auth}) as r:
        assert r.status == 200, await r.text()
        answer: dict[str, Any] = await r.json()
        request_id = r.headers[REQUEST_ID_HEADER]
    for _ in range(200):  # the record is kept just after the answer's last byte
        async with client.get(proxy.make_url("/adaptive/requests"), headers=auth) as r:
            records = [x for x in (await r.json())["requests"] if x["request_id"] == request_id]
        if records:
            text = answer["choices"][0]["message"]["content"]
            return {"text": text, "timings": answer["timings"], "record": records[0]}
        await asyncio.sleep(0.05)
    raise AssertionError(f"no record of request {request_id}")


async def messages(
    client: aiohttp.ClientSession, proxy: TestServer, session: str, user: str, system: str = SYSTEM, max_tokens: int = 4
) -> dict[str, Any]:
    """One greedy turn as Claude Code sends it (`/v1/messages`, its session header, the system prompt apart):
    {"text", "record"}, the record with llama-server's timings."""
    body = {
        "model": "m",
        "system": [{"type": "text", "text": system}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": user}]}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    headers = {"x-claude-code-session-id": session, "anthropic-version": "2023-06-01"}
    async with client.post(proxy.make_url("/v1/messages?beta=true"), json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        answer: dict[str, Any] = await r.json()
        request_id = r.headers[REQUEST_ID_HEADER]
    for _ in range(200):  # the record is kept just after the answer's last byte
        async with client.get(proxy.make_url("/adaptive/requests")) as r:
            records = [x for x in (await r.json())["requests"] if x["request_id"] == request_id]
        if records:
            text = "".join(b.get("text", "") for b in answer["content"] if isinstance(b, dict))
            return {"text": text, "record": records[0]}
        await asyncio.sleep(0.05)
    raise AssertionError(f"no record of request {request_id}")


async def erase(client: aiohttp.ClientSession, proxy: TestServer, key: str | None = None) -> None:
    """Another session took the slot: it holds nothing of the head (through the proxy, so the router knows)."""
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    async with client.post(proxy.make_url("/adaptive/profiles/p/erase"), headers=auth) as r:
        assert r.status == 200, await r.text()
