"""Never stricter than llama-server: the request shapes agents send (synthetic bodies of their structure in
tests/data/agent-shapes/; the agents' recorded requests too, from where tests/support/processes/outside.py finds them)
and seeded variants of them (tests/stress/fuzz_cases.py's mutations, and a newer client's fields), each sent to a real
llama-server directly and through the proxy. Wherever llama-server answers 2xx, so does the proxy. And what Claude
Code needs of the proxy beyond its shapes: its token count, its context overflow worded so that it compacts, its
session, and its billing line's per-request value not counted as a new prompt."""

from __future__ import annotations

import copy
import json
import random
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.stress.fuzz_cases import mutated
from tests.support.processes.outside import AGENT_TRAFFIC, agent_traffic
from tests.support.processes.servers import LlamaServer, ProxyProcess

ROOT = Path(__file__).resolve().parents[3]
SHAPES = ROOT / "tests" / "data" / "agent-shapes"
PATHS = {"claude-code": "/v1/messages?beta=true", "codex": "/v1/responses"}  # the others: chat completions
CLAUDE_SESSION = "11111111-2222-3333-4444-555555555555"
HEADERS = {
    "claude-code": {"X-Claude-Code-Session-Id": CLAUDE_SESSION},
    "opencode": {"x-session-id": "ses_synthetic"},
    "codex": {"session-id": "01a2286d-0000-7000-8000-000000000000"},
}
_SENT_HEADERS = ("x-session-id", "x-session-affinity", "session-id", "thread-id", "user-agent", "originator")


def _bodies() -> list[tuple[str, dict[str, Any]]]:
    found = [(p.stem, json.loads(p.read_text())) for p in sorted(SHAPES.glob("*.json"))]
    assert len(found) >= 9, f"the agent shapes are missing from {SHAPES}"
    return found


def _path(name: str) -> str:
    return next((path for agent, path in PATHS.items() if name.startswith(agent)), "/v1/chat/completions")


def _headers(name: str) -> dict[str, str]:
    return next((h for agent, h in HEADERS.items() if name.startswith(agent)), {})


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
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
    if "output" in answer:
        return json.dumps(answer["output"])
    return "".join(str(block.get("text", "")) for block in answer["content"])


def _ended(raw: bytes) -> bool:
    """A stream that ended as its API ends one."""
    return any(end in raw for end in (b"data: [DONE]", b"message_stop", b"response.completed"))


@pytest.mark.parametrize(("name", "body"), _bodies(), ids=[name for name, _ in _bodies()])
def test_each_agent_shape_is_answered_as_llama_server_answers_it(
    tiny_server: LlamaServer, proxy: ProxyProcess, name: str, body: dict[str, Any]
) -> None:
    path = _path(name)
    direct_status, direct = _post(tiny_server.url + path, body)
    status, through = _post(proxy.base + path, body, _headers(name))
    assert status == 200, through[:300]
    if direct_status != 200:  # llama-server refuses it (Codex's call-less tool output): the proxy's repair takes it
        assert direct_status == 400 and proxy.requests()[-1]["repaired"], (direct[:300], proxy.requests()[-1])
    elif body.get("stream"):
        assert _ended(through), through[-300:]
    else:
        assert _text(through) == _text(direct)  # greedy, one server: the same answer


def _recorded() -> list[tuple[str, str, dict[str, str], dict[str, Any]]]:
    """The first request of each kind (agent, path, main or side) the agents sent, generation capped at 4 tokens.
    Read while the tests are collected: none without the recordings, and the test below says why."""
    out: list[tuple[str, str, dict[str, str], dict[str, Any]]] = []
    seen: set[tuple[str, str, str]] = set()
    for file in sorted(AGENT_TRAFFIC.glob("*.jsonl")) if AGENT_TRAFFIC.is_dir() else []:
        for line in file.read_text().splitlines():
            record = json.loads(line)
            body, kind = record.get("body"), (file.stem, record["path"], record["truth"]["kind"])
            if record["method"] != "POST" or not isinstance(body, dict) or kind in seen:
                continue
            seen.add(kind)
            cap = "max_output_tokens" if record["path"].endswith("/responses") else "max_tokens"
            headers = {k: v for k, v in record["headers"].items() if k.lower() in _SENT_HEADERS}
            out.append(("-".join(kind).replace("/", "_"), record["path"], headers, {**body, cap: 4}))
    return out


@pytest.mark.parametrize(("name", "path", "headers", "body"), _recorded(), ids=[r[0] for r in _recorded()])
def test_each_recorded_agent_request_is_answered_as_llama_server_answers_it(
    tiny_server: LlamaServer, proxy: ProxyProcess, name: str, path: str, headers: dict[str, str], body: dict[str, Any]
) -> None:
    direct_status, _ = _post(tiny_server.url + path, body)
    status, through = _post(proxy.base + path, body, headers)
    if 200 <= direct_status < 300:
        assert 200 <= status < 300, (name, through[:300])
    else:  # llama-server refuses it: the proxy may repair it (requests/body/compat.py) or refuse it as well
        assert status == 200 or 400 <= status < 500, (name, direct_status, through[:300])


def test_the_recorded_corpus_is_there_and_not_empty() -> None:
    agent_traffic()  # missing: skipped on a developer's machine, failed in CI
    assert len(_recorded()) >= 5


def _vary(body: dict[str, Any], rng: random.Random) -> tuple[str, dict[str, Any]]:
    """One well-formed variant a newer client might send (unknown roles, block types and fields), else one of the
    fuzzer's mutations (a value of another type anywhere, a field deleted)."""
    out = copy.deepcopy(body)
    messages = out.get("messages") or out.get("input")
    pick = rng.randrange(8)
    if pick == 0 and isinstance(messages, list):
        messages.insert(rng.randrange(1, len(messages) + 1), {"role": "system", "content": "Mid-conversation note."})
    elif pick == 1 and isinstance(messages, list):
        messages[-1] = {**messages[-1], "role": rng.choice(["developer", "critic", "observer"])}
    elif pick == 2 and isinstance(messages, list):
        content = messages[0]["content"]
        blocks = content if isinstance(content, list) else [{"type": "text", "text": content}]
        messages[0]["content"] = [*blocks, {"type": rng.choice(["future_block", "citation"]), "data": "x"}]
    elif pick == 3:
        out[f"x_new_option_{rng.randrange(100)}"] = {"nested": [1, "two", None]}
    elif pick == 4:
        out["metadata"] = {"user_id": json.dumps({"session_id": f"s-{rng.randrange(10**6)}"})}
    else:
        return mutated(body, rng)
    return "newer_client", out


# Where the proxy refuses on purpose what llama-server answers 2xx: a value llama-server reads without checking its
# type (its `json_value` gives the default for a wrong type, a non-array `messages` is skipped), so it serves another
# request than the one sent: the client's mistake answered as one (requests/body/shapes.py, parse.py). Each excuse is
# the exact (field, reason) of the proxy's 400 (indices as N; a wrong type's "but got ..." left out), and each is seen
# in these variants: a refusal of the same field for another reason (a role the proxy does not know, say) is a defect.
_DELIBERATE = {
    ("model", "expected a string"): "a label to a single-model server, the preset a router-mode one loads",
    ("messages", "expected an array"): "llama-server's Anthropic conversion skips it and answers the system alone",
    ("messages[N].content[N].type", "expected a string."): "not a string: the block is dropped",
    ("system", "expected a string or an array of text blocks."): "another type: the system prompt is dropped",
    ("system[N]", "expected a content part object."): "not an object: the block is dropped",
    ("system[N].type", "expected a string."): "not a string: the block is dropped",
    ("system[N].text", "expected a string."): "not a string: read as an empty text",
    ("tools", "expected an array of objects."): "an item that is not an object: dropped",
    ("tools[N].name", "expected a string."): "not a string: a tool with an empty name",
    ("stream_options", "expected an object"): "another type: read as none, the usage chunk asked for is not sent",
    ("max_tokens", "expected an integer"): "a boolean: read as none, so the answer is not capped at all",
    ("tools[N].parameters", "expected an object (a JSON schema)."): "as input_schema below, on chat completions",
    ("tools[N].input_schema", "expected an object (a JSON schema)."): "the tiny model's template renders no tools, so "
    "its server ignores it; on one that renders them (the embedded Qwen's) llama-server refuses it too (400, 'schema "
    "must be an object')",
}
_INVALID = re.compile(
    r"Invalid '(?P<field>[^']+)': (?P<reason>.+)|Invalid type for '(?P<typed>[^']+)': (?P<wanted>.+?), but got .+"
)


def refusal(answer: bytes) -> tuple[str, str] | None:
    """The (field, reason) a proxy's 400 names, in either API's error shape; None for another answer."""
    try:
        error = json.loads(answer).get("error")
    except (ValueError, AttributeError):
        return None
    found = _INVALID.fullmatch(str(error.get("message", ""))) if isinstance(error, dict) else None
    if found is None:
        return None
    field = found["field"] or found["typed"]
    return re.sub(r"\[\d+\]", "[N]", field), found["reason"] or found["wanted"]


def test_an_excuse_is_the_exact_field_and_reason_it_was_written_for() -> None:
    """The refusal that once blocked Claude Code (a mid-conversation `system` message) names a field whose other
    refusals were once excused, for another reason: not excused. (A role that is not a string is refused by
    llama-server too: no excuse for `messages[N].role` at all.)"""
    defect = json.dumps({"error": {"message": "Invalid 'messages[1].role': unknown role 'system'"}}).encode()
    assert refusal(defect) == ("messages[N].role", "unknown role 'system'")
    assert refusal(defect) not in _DELIBERATE
    content = json.dumps({"error": {"message": "Invalid 'messages[0].content[2].type': unknown block 'citation'"}})
    assert refusal(content.encode()) not in _DELIBERATE
    typed = json.dumps(
        {"type": "error", "error": {"message": "Invalid type for 'model': expected a string, but got a number."}}
    )
    assert refusal(typed.encode()) in _DELIBERATE


def test_seeded_variants_are_never_refused_where_llama_server_takes_them(
    tiny_server: LlamaServer, proxy: ProxyProcess
) -> None:
    rng = random.Random(38)
    compared, refused, excused = 0, [], set()
    for _ in range(20):
        for name, body in _bodies():
            kind, variant = _vary(body, rng)
            path = _path(name)
            direct_status, _ = _post(tiny_server.url + path, variant)
            status, through = _post(proxy.base + path, variant, _headers(name))
            if 200 <= direct_status < 300:
                compared += 1
                why = refusal(through) if status == 400 else None
                if why in _DELIBERATE:
                    excused.add(why)
                elif not 200 <= status < 300:
                    refused.append((name, kind, status, through[:300]))
            else:
                assert status < 500, (name, kind, direct_status, status, through[:300])
    assert refused == [], "\n".join(map(repr, refused))
    assert compared >= 100, "too few variants that llama-server takes to say anything"
    assert excused, "no deliberate refusal met: the variants no longer reach the checks they were written for"


_CHAT = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi."}]}
_MESSAGES = {"model": "m", "max_tokens": 2, "system": [{"type": "text", "text": "Be brief."}], **_CHAT}
_EACH_EXCUSE: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {
    ("model", "expected a string"): ("/v1/chat/completions", {**_CHAT, "model": 5}),
    ("messages", "expected an array"): ("/v1/messages", {**_MESSAGES, "messages": {"role": "user"}}),
    ("messages[N].content[N].type", "expected a string."): (
        "/v1/messages",
        {**_MESSAGES, "messages": [{"role": "user", "content": [{"type": 5, "text": "Hi."}]}]},
    ),
    ("system", "expected a string or an array of text blocks."): ("/v1/messages", {**_MESSAGES, "system": 5}),
    ("system[N]", "expected a content part object."): ("/v1/messages", {**_MESSAGES, "system": ["Be brief."]}),
    ("max_tokens", "expected an integer"): ("/v1/chat/completions", {**_CHAT, "max_tokens": True}),
    ("stream_options", "expected an object"): (
        "/v1/chat/completions",
        {**_CHAT, "stream": True, "stream_options": "include_usage"},
    ),
    ("tools[N].parameters", "expected an object (a JSON schema)."): (
        "/v1/chat/completions",
        {**_CHAT, "tools": [{"type": "function", "function": {"name": "t", "parameters": 5}}]},
    ),
    ("system[N].type", "expected a string."): ("/v1/messages", {**_MESSAGES, "system": [{"type": 5, "text": "B."}]}),
    ("system[N].text", "expected a string."): ("/v1/messages", {**_MESSAGES, "system": [{"type": "text", "text": 5}]}),
    ("tools", "expected an array of objects."): ("/v1/messages", {**_MESSAGES, "tools": [5]}),
    ("tools[N].name", "expected a string."): (
        "/v1/messages",
        {**_MESSAGES, "tools": [{"name": 5, "input_schema": {"type": "object"}}]},
    ),
    ("tools[N].input_schema", "expected an object (a JSON schema)."): (
        "/v1/messages",
        {**_MESSAGES, "tools": [{"name": "t", "input_schema": 5}]},
    ),
}


@pytest.mark.parametrize("excuse", list(_EACH_EXCUSE), ids=["|".join(e) for e in _EACH_EXCUSE])
def test_each_excuse_is_a_request_llama_server_takes_and_the_proxy_refuses_for_that_reason(
    tiny_server: LlamaServer, proxy: ProxyProcess, excuse: tuple[str, str]
) -> None:
    """No excuse stands for nothing: each is met by a request llama-server answers 2xx (serving another request than
    the one sent) and the proxy refuses with exactly that field and reason."""
    assert set(_EACH_EXCUSE) == set(_DELIBERATE)
    path, body = _EACH_EXCUSE[excuse]
    direct_status, direct = _post(tiny_server.url + path, body)
    status, through = _post(proxy.base + path, body)
    assert 200 <= direct_status < 300, direct[:300]
    assert (status, refusal(through)) == (400, excuse), through[:300]
