"""A seeded generator of bad HTTP requests for the proxy, as raw bytes: malformed and truncated JSON, wrong types in
every field llama-server reads, deep nesting, huge strings, invalid UTF-8, NUL bytes, duplicate and oversized
headers, broken framing (Content-Length, chunked bodies that stop), HTTP/1.0 and odd versions, slow headers, path
and Host tricks that would make an open proxy contact another host, and llama-server's control endpoints.

The same seed gives the same cases. A few valid requests are mixed in: they must pass through (2xx)."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

Json = Any


@dataclass(frozen=True)
class Case:
    kind: str  # the generator that made it
    data: bytes  # sent as they are
    bad: bool = True  # False: a valid request, which must be answered 2xx
    stop_after_send: bool = False  # the request is cut off: close without waiting for an answer
    drip_s: float = 0.0  # send the bytes slowly, over this long (slowloris)


@dataclass(frozen=True)
class Target:
    host: str  # the proxy's Host header value
    canary: str  # host:port of a listener the proxy must never contact


_TEMPLATES: dict[str, Json] = {
    "/v1/chat/completions": {
        "model": "m",
        "max_tokens": 4,
        "temperature": 0,
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            {"role": "user", "content": [{"type": "text", "text": "more"}]},
        ],
        "tools": [
            {
                "type": "function",
                "function": {"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}},
            }
        ],
        "stop": ["\n\n"],
        "seed": 1,
        "top_k": 40,
        "n_probs": 0,
        "logit_bias": {},
        "stream": False,
    },
    "/v1/completions": {"model": "m", "prompt": "def f(", "max_tokens": 4, "temperature": 0, "stop": "x"},
    "/completion": {"prompt": ["hi", 12, [13, 14]], "n_predict": 4, "cache_prompt": True, "samplers": ["top_k"]},
    "/v1/responses": {
        "model": "m",
        "max_output_tokens": 4,
        "instructions": "terse",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
    },
    "/v1/messages": {
        "model": "m",
        "max_tokens": 4,
        "system": "terse",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "again"},
        ],
    },
}
_VALID: dict[str, Json] = {
    "/v1/chat/completions": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": "m", "prompt": "def f(", "max_tokens": 4},
    "/v1/messages": {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "m", "max_output_tokens": 4, "input": "hi"},
}
_WRONG: list[Json] = [
    0,
    -1,
    1.5,
    1e308,
    True,
    False,
    None,
    "",
    "x",
    [],
    [1, "a"],
    {},
    {"a": 1},
    [[[]]],
    "\x00",
    -(2**63),
    2**64,
    "\u202e\ufeff",
    {"type": None},
    [{"role": 1}],
]


def _http(
    method: str,
    target: str,
    host: str | None,
    headers: list[tuple[str, str]],
    body: bytes,
    version: str = "HTTP/1.1",
    length: bool = True,
) -> bytes:
    lines = [f"{method} {target} {version}"]
    if host is not None:
        lines.append(f"Host: {host}")
    lines += [f"{k}: {v}" for k, v in headers]
    if length:
        lines.append(f"Content-Length: {len(body)}")
    lines.append("Connection: close")
    return "\r\n".join(lines).encode("utf-8", "surrogateescape") + b"\r\n\r\n" + body


def _json(body: Json) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _paths(value: Json, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _paths(item, (*prefix, i))


def _set(body: Json, path: tuple[Any, ...], value: Json) -> Json:
    out = copy.deepcopy(body)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def _delete(body: Json, path: tuple[Any, ...]) -> Json:
    out = copy.deepcopy(body)
    node = out
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return out


def mutated(body: Json, rng: random.Random) -> tuple[str, Json]:
    """One seeded variant of a well-formed body, as `Generator` makes its wrong_type and missing_field cases: a value
    anywhere in it replaced by one of another type, or a field or item deleted. (kind, the variant)."""
    where = rng.choice([p for p in _paths(body) if p])
    if rng.random() < 0.2:
        return "missing_field", _delete(body, where)
    return "wrong_type", _set(body, where, rng.choice(_WRONG))


class Generator:
    def __init__(self, seed: int, target: Target) -> None:
        self.rng = random.Random(seed)
        self.t = target
        kinds: list[tuple[Callable[[], Case], int]] = [
            (self.wrong_type, 30),
            (self.missing_field, 6),
            (self.bad_json, 10),
            (self.deep, 3),
            (self.huge, 2),
            (self.bad_utf8, 4),
            (self.nul, 4),
            (self.headers, 8),
            (self.framing, 8),
            (self.version, 4),
            (self.method, 3),
            (self.path, 8),
            (self.host, 4),
            (self.control, 3),
            (self.slow, 1),
            (self.valid, 6),
        ]
        self.kinds = [k for k, _ in kinds]
        self.weights = [w for _, w in kinds]

    def cases(self, count: int) -> Iterator[Case]:
        for _ in range(count):
            yield self.rng.choices(self.kinds, self.weights)[0]()

    def _post(self, kind: str, path: str, body: bytes, extra: list[tuple[str, str]] | None = None) -> Case:
        headers = [("Content-Type", "application/json"), *(extra or [])]
        return Case(kind, _http("POST", path, self.t.host, headers, body))

    def _template(self) -> tuple[str, Json]:
        path = self.rng.choice(list(_TEMPLATES))
        body = copy.deepcopy(_TEMPLATES[path])
        if self.rng.random() < 0.3:
            body["stream"] = True
        return self.rng.choice(["", "/p/fuzz"]) + path, body

    def wrong_type(self) -> Case:
        path, body = self._template()
        where = self.rng.choice([p for p in _paths(body) if p])
        return self._post("wrong_type", path, _json(_set(body, where, self.rng.choice(_WRONG))))

    def missing_field(self) -> Case:
        path, body = self._template()
        where = self.rng.choice([p for p in _paths(body) if p])
        return self._post("missing_field", path, _json(_delete(body, where)))

    def bad_json(self) -> Case:
        path, body = self._template()
        raw = _json(body)
        choice = self.rng.randrange(5)
        if choice == 0:
            data = raw[: self.rng.randrange(len(raw))]  # truncated
        elif choice == 1:
            data = bytes(self.rng.randrange(256) for _ in range(self.rng.randrange(1, 200)))
        elif choice == 2:
            data = raw.replace(b'"', b"'", 1)
        elif choice == 3:
            data = b'{"messages": [' * 3 + b"]]"
        else:
            data = raw + b"garbage"
        return self._post("bad_json", path, data)

    def deep(self) -> Case:
        path, body = self._template()
        depth = self.rng.choice([65, 200, 5000, 100_000])
        nested = "[" * depth + "]" * depth
        if self.rng.random() < 0.5:
            return self._post("deep", path, ('{"messages": ' + nested + ', "prompt": "x", "input": "x"}').encode())
        where = self.rng.choice([p for p in _paths(body) if p])
        marker = "\u0001NEST\u0001"
        raw = _json(_set(body, where, marker)).replace(json.dumps(marker).encode(), nested.encode())
        return self._post("deep", path, raw)

    def huge(self) -> Case:
        path, body = self._template()
        where = self.rng.choice([p for p in _paths(body) if p])
        size = self.rng.choice([300_000, 2_000_000])  # under and over the proxy's 1 MiB limit in the runs
        return self._post("huge", path, _json(_set(body, where, "y" * size)))

    def bad_utf8(self) -> Case:
        path, body = self._template()
        raw = _json(body)
        cut = raw.find(b'"', self.rng.randrange(len(raw)))
        bad = self.rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80"])
        return self._post("bad_utf8", path, raw[: cut + 1] + bad + raw[cut + 1 :] if cut >= 0 else raw + bad)

    def nul(self) -> Case:
        path, body = self._template()
        raw = _json(body)
        spot = self.rng.randrange(len(raw))
        if self.rng.random() < 0.5:
            return self._post("nul", path, raw[:spot] + b"\x00" + raw[spot:])
        where = self.rng.choice([p for p in _paths(body) if p])
        return self._post("nul", path, _json(_set(body, where, "a\x00b")))

    def headers(self) -> Case:
        path, body = self._template()
        raw = _json(body)
        choice = self.rng.randrange(7)
        h = self.t.host
        if choice == 0:  # two different lengths
            data = _http("POST", path, h, [("Content-Length", str(len(raw) + 5))], raw)
        elif choice == 1:
            data = _http("POST", path, h, [("Host", "attacker.example")], raw)
        elif choice == 2:
            data = _http("POST", path, h, [("X-Big", "v" * self.rng.choice([9000, 70_000]))], raw)
        elif choice == 3:
            data = _http("POST", path, h, [(f"X-H{i}", "v") for i in range(self.rng.choice([120, 1000]))], raw)
        elif choice == 4:
            data = _http("POST", path, h, [("X-Nul", "a\x00b")], raw)
        elif choice == 5:
            data = _http("POST", path, h, [("Bad Name", "v"), ("NoColon", "")], raw).replace(b"NoColon: ", b"NoColon")
        else:
            data = _http("POST", path, h, [("Content-Type", "application/json"), ("Content-Type", "text/plain")], raw)
        return Case("headers", data)

    def framing(self) -> Case:
        path, body = self._template()
        raw = _json(body)
        h = self.t.host
        choice = self.rng.randrange(7)
        base = [("Content-Type", "application/json")]
        if choice < 3:
            value = ["-1", "abc", "99999999999999999999999"][choice]
            return Case("framing", _http("POST", path, h, [*base, ("Content-Length", value)], raw, length=False))
        if choice == 3:  # the body stops before its length
            data = _http("POST", path, h, base, raw)
            return Case("framing", data[: len(data) - len(raw) // 2], stop_after_send=True)
        chunked = [*base, ("Transfer-Encoding", "chunked")]
        if choice == 4:  # a chunked body that stops
            data = _http("POST", path, h, chunked, f"{len(raw):x}\r\n".encode() + raw[: len(raw) // 2], length=False)
            return Case("framing", data, stop_after_send=True)
        if choice == 5:
            return Case("framing", _http("POST", path, h, chunked, b"zz\r\nabc\r\n0\r\n\r\n", length=False))
        data = _http(
            "POST",
            path,
            h,
            [*chunked, ("Content-Length", "3")],
            f"{len(raw):x}\r\n".encode() + raw + b"\r\n0\r\n\r\n",
            length=False,
        )
        return Case("framing", data)

    def version(self) -> Case:
        choice = self.rng.randrange(5)
        if choice == 0:
            return Case("version", b"GET /v1/models HTTP/1.0\r\n\r\n", bad=False)
        if choice == 1:
            return Case("version", b"GET /v1/models\r\n\r\n")
        if choice == 2:
            return Case("version", b"GET /v1/models HTTP/2.0\r\nHost: " + self.t.host.encode() + b"\r\n\r\n")
        if choice == 3:
            return Case("version", b"GET /v1/models HTTP/1.1\r\nConnection: close\r\n\r\n")
        return Case("version", b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(40))  # a TLS hello

    def method(self) -> Case:
        choice = self.rng.randrange(4)
        method = ["PROPFIND", "get", "X" * 300, f"CONNECT {self.t.canary}"][choice]
        target = f"{self.t.canary}" if choice == 3 else "/v1/chat/completions"
        if choice == 3:
            return Case("method", _http("CONNECT", target, self.t.canary, [], b""))
        return Case("method", _http(method, target, self.t.host, [], b"{}"))

    def path(self) -> Case:
        c = self.t.canary
        target = self.rng.choice(
            [
                "/p/%2e%2e/v1/chat/completions",
                "/p/../v1/chat/completions",
                "/p/./v1/chat/completions",
                "/p/%2E%2E%2Fv1/chat/completions",
                f"//{c}/v1/chat/completions",
                f"http://{c}/v1/chat/completions",
                f"https://{c}/x",
                "/v1/chat/completions/../completions",
                "/%2e%2e/%2e%2e/etc/passwd",
                "/v1/chat%2Fcompletions",
                "/v1/%00/models",
                "/v1/chat/completions%3Fa=1",
                "/p/-bad/v1/models",
                "/p/" + "a" * 200 + "/v1/models",
                "/" + "x" * 10_000,
                "/v1/%zz",
                "/v1/%ff%fe",
                "*",
                "@" + c + "/x",
                "/p/ok/../../v1/chat/completions",
                "/v1\\chat\\completions",
                "/v1/chat/completion%73",
            ]
        )
        method = self.rng.choice(["GET", "POST"])
        body = _json(_TEMPLATES["/v1/chat/completions"]) if method == "POST" else b""
        return Case("path", _http(method, target, self.t.host, [("Content-Type", "application/json")], body))

    def host(self) -> Case:
        host = self.rng.choice(
            [
                "attacker.example",
                "attacker.example:8088",
                self.t.canary,
                "127.0.0.1@attacker.example",
                "",
                "localhost.attacker.example",
                "127.0.0.1.nip.io",
                "[::ffff:7f00:1]",
                "0x7f.1",
            ]
        )
        path = self.rng.choice(["/adaptive/health", "/v1/models", "/adaptive/profiles/plain/restart"])
        method = "POST" if path.endswith("restart") else "GET"
        return Case("host", _http(method, path, host, [], b""))

    def control(self) -> Case:
        target, body = self.rng.choice(
            [
                ("/slots/0?action=erase", b""),
                ("/slots/0?action=save", b'{"filename": "../../x.bin"}'),
                ("/slots/0?action=restore", b'{"filename": "/etc/passwd"}'),
                ("/models/load", b'{"model": "other"}'),
                ("/props", b'{"n_ctx": 1}'),
                ("/lora-adapters", b"[]"),
                ("/p/x/slots/0?action=erase", b""),
            ]
        )
        return Case("control", _http("POST", target, self.t.host, [("Content-Type", "application/json")], body))

    def slow(self) -> Case:
        path, body = self._template()
        data = _http("POST", path, self.t.host, [("Content-Type", "application/json")], _json(body))
        return Case("slow", data[: self.rng.randrange(5, 60)], stop_after_send=True, drip_s=0.5)

    def valid(self) -> Case:
        path = self.rng.choice(list(_VALID))
        return Case(
            "valid",
            _http("POST", path, self.t.host, [("Content-Type", "application/json")], _json(_VALID[path])),
            bad=False,
        )
