"""Never stricter than llama-server: the request shapes agents send (Claude Code, Qwen Code: synthetic bodies of
their structure in tests/data/agent-shapes/) and seeded variants of them, each sent to a real llama-server directly
and through the proxy. Wherever llama-server answers 2xx, so does the proxy."""

from __future__ import annotations

import copy
import json
import random
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.servers import LlamaServer, ProxyProcess

SHAPES = Path(__file__).resolve().parents[1] / "data" / "agent-shapes"
PATHS = {"claude-code": "/v1/messages?beta=true", "qwen-code": "/v1/chat/completions"}
CLAUDE_SESSION = "11111111-2222-3333-4444-555555555555"


def _bodies() -> list[tuple[str, dict[str, Any]]]:
    found = [(p.stem, json.loads(p.read_text())) for p in sorted(SHAPES.glob("*.json"))]
    assert len(found) >= 4, f"the agent shapes are missing from {SHAPES}"
    return found


def _path(name: str) -> str:
    return next(path for agent, path in PATHS.items() if name.startswith(agent))


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture(scope="module")
def proxy(tiny_server: LlamaServer) -> Iterator[ProxyProcess]:
    proc = ProxyProcess("--profile", f"plain={tiny_server.url}")
    yield proc
    proc.stop()


def _text(raw: bytes) -> str:
    answer = json.loads(raw)
    if "choices" in answer:
        return str(answer["choices"][0]["message"].get("content"))
    return "".join(str(block.get("text", "")) for block in answer["content"])


@pytest.mark.parametrize(("name", "body"), _bodies(), ids=[name for name, _ in _bodies()])
def test_each_agent_shape_is_answered_as_llama_server_answers_it(
    tiny_server: LlamaServer, proxy: ProxyProcess, name: str, body: dict[str, Any]
) -> None:
    path = _path(name)
    direct_status, direct = _post(tiny_server.url + path, body)
    assert direct_status == 200, direct[:300]  # the shape is one llama-server takes: the point of the corpus
    headers = {"X-Claude-Code-Session-Id": CLAUDE_SESSION} if name.startswith("claude") else {}
    status, through = _post(proxy.base + path, body, headers)
    assert status == 200, through[:300]
    if not body.get("stream"):
        assert _text(through) == _text(direct)  # greedy, one server: the same answer


def _vary(body: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """One well-formed variant a newer client might send: unknown roles, block types and fields."""
    out = copy.deepcopy(body)
    messages = out["messages"]
    pick = rng.randrange(5)
    if pick == 0:
        messages.insert(rng.randrange(1, len(messages) + 1), {"role": "system", "content": "Mid-conversation note."})
    elif pick == 1:
        messages[-1] = {**messages[-1], "role": rng.choice(["developer", "critic", "observer"])}
    elif pick == 2:
        content = messages[0]["content"]
        blocks = content if isinstance(content, list) else [{"type": "text", "text": content}]
        messages[0]["content"] = [*blocks, {"type": rng.choice(["future_block", "citation"]), "data": "x"}]
    elif pick == 3:
        out[f"x_new_option_{rng.randrange(100)}"] = {"nested": [1, "two", None]}
    else:
        out["metadata"] = {"user_id": json.dumps({"session_id": f"s-{rng.randrange(10**6)}"})}
    return out


def test_seeded_variants_are_never_refused_where_llama_server_takes_them(
    tiny_server: LlamaServer, proxy: ProxyProcess
) -> None:
    rng = random.Random(38)
    compared = 0
    for _ in range(3):
        for name, body in _bodies():
            variant = _vary(body, rng)
            path = _path(name)
            direct_status, _ = _post(tiny_server.url + path, variant)
            status, through = _post(proxy.base + path, variant)
            if 200 <= direct_status < 300:
                compared += 1
                assert 200 <= status < 300, (name, variant, through[:300])
    assert compared >= 6, "too few variants that llama-server takes to say anything"


def test_claude_codes_session_header_groups_its_requests(proxy: ProxyProcess) -> None:
    name, body = next((n, b) for n, b in _bodies() if n == "claude-code-messages")
    headers = {"X-Claude-Code-Session-Id": "cc-" + CLAUDE_SESSION}
    ids = []
    for turn in range(2):
        turn_body = {**body, "messages": [*body["messages"], {"role": "user", "content": f"t{turn}"}]}
        req = urllib.request.Request(
            proxy.base + _path(name),
            data=json.dumps(turn_body).encode(),
            headers={"Content-Type": "application/json", **headers},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            ids.append(resp.headers["x-adaptive-spec-request-id"])
    records = {r["request_id"]: r for r in proxy.requests()}
    sessions = {records[i]["session_id"] for i in ids}
    assert len(sessions) == 1 and records[ids[0]]["session_source"] != "new"
