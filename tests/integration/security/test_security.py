"""The proxy as an attacker and a careless client meet it, in front of a REAL llama-server (tiny model): client
mistakes are 400s in the client's own error shape, malformed HTTP does not flood the log, paths are decided once,
slot actions stay the proxy's, foreign Hosts and origins are refused, keys are checked on every route, and no
request makes the proxy contact anything but its profiles."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes.servers import LlamaServer, ProxyProcess, http_json, wait_until

KEY = "sk-test-0123456789"
CHAT = {"model": "m", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def proxy(tiny_server: LlamaServer) -> Iterator[ProxyProcess]:
    proc = ProxyProcess("--profile", f"plain={tiny_server.url}")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def keyed(tiny_server: LlamaServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    key_file = tmp_path_factory.mktemp("key") / "key"
    key_file.write_text(KEY + "\n")
    proc = ProxyProcess(
        "--profile",
        f"plain={tiny_server.url}",
        "--api-key-file",
        str(key_file),
        "--project-key",
        "sk-project=projX",
        "--cors-origin",
        "https://app.example",
        "--allow-host",
        "box.lan",
    )
    yield proc
    proc.stop()


class Answer:
    def __init__(self, raw: bytes) -> None:
        head, _, self.body = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1]) if lines[0].startswith("HTTP/") else 0
        self.headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}

    def json(self) -> Any:
        return json.loads(self.body)


def raw(port: int, data: bytes) -> Answer:
    """Bytes as they are, over a fresh connection; the whole answer (every request says `Connection: close`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return Answer(b"".join(chunks))


def request(
    port: int,
    method: str,
    target: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    host: str | None = None,
) -> Answer:
    data = b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    lines = [
        f"{method} {target} HTTP/1.1",
        f"Host: {host or f'127.0.0.1:{port}'}",
        "Connection: close",
        f"Content-Length: {len(data)}",
    ]
    if body is not None and not any(k.lower() == "content-type" for k in headers or {}):
        lines.append("Content-Type: application/json")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return raw(port, "\r\n".join(lines).encode() + b"\r\n\r\n" + data)


def _port(proc: ProxyProcess) -> int:
    return proc.port


def _upstream_port(server: LlamaServer) -> int:
    return server.port


def _assert_openai_error(answer: Answer, status: int, code: str) -> dict[str, Any]:
    assert answer.status == status, (answer.status, answer.body[:300])
    error = answer.json()["error"]
    assert error["code"] == code and error["message"], error
    return dict(error)


def _assert_anthropic_error(answer: Answer, status: int, kind: str) -> str:
    assert answer.status == status, (answer.status, answer.body[:300])
    body = answer.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert set(body["error"]) == {"type", "message"}
    return str(body["error"]["message"])


# --- client mistakes are 400s naming the field, in the API's own error shape ----------------------------------------


def test_llama_server_itself_answers_500_to_a_message_without_role(tiny_server: LlamaServer) -> None:
    # Why the proxy checks shapes: llama-server blames itself for the client's mistake.
    bad = {**CHAT, "messages": [{"content": "hi"}]}
    assert request(_upstream_port(tiny_server), "POST", "/v1/chat/completions", bad).status >= 500


@pytest.mark.parametrize(
    ("path", "messages", "param"),
    [
        ("/v1/chat/completions", [{"content": "hi"}], "messages[0].role"),
        ("/v1/chat/completions", [{"role": "user", "content": 5}], "messages[0].content"),
        (
            "/v1/chat/completions",
            [{"role": "user", "content": [{"type": "text", "text": 5}]}],
            "messages[0].content[0].text",
        ),
        ("/p/a/v1/chat/completions", [{"role": "user", "content": {"text": "hi"}}], "messages[0].content"),
    ],
)
def test_bad_message_shapes_are_400_naming_the_field(
    proxy: ProxyProcess, path: str, messages: list[Any], param: str
) -> None:
    answer = request(_port(proxy), "POST", path, {**CHAT, "messages": messages})
    error = _assert_openai_error(answer, 400, "invalid_value")
    assert error["param"] == param and param in error["message"]
    assert proxy.requests()[-1]["status"] == 400


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"model": "m", "max_tokens": 4, "messages": [{"content": "hi"}]}, "messages[0].role"),
        ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (b"{broken", "not valid JSON"),
    ],
)
def test_anthropic_clients_get_anthropic_shaped_errors(proxy: ProxyProcess, body: Any, words: str) -> None:
    answer = request(_port(proxy), "POST", "/v1/messages", body)
    assert words in _assert_anthropic_error(answer, 400, "invalid_request_error")


def test_an_unknown_profile_pin_on_messages_is_anthropic_shaped(proxy: ProxyProcess) -> None:
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    answer = request(_port(proxy), "POST", "/v1/messages", body, {"x-adaptive-spec-profile": "nope"})
    assert "known profiles: plain" in _assert_anthropic_error(answer, 400, "invalid_request_error")


def test_llama_servers_own_errors_on_messages_are_anthropic_shaped(proxy: ProxyProcess) -> None:
    too_long = "a " * 40_000  # beyond the tiny server's 32k context: llama-server's own 400
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": too_long}]}
    answer = request(_port(proxy), "POST", "/v1/messages", body)
    # In Anthropic's own words for an overflow, which is what makes Claude Code compact its history.
    message = _assert_anthropic_error(answer, 400, "invalid_request_error")
    assert message.startswith("prompt is too long: ") and message.endswith(" maximum"), message


def test_valid_requests_still_pass(proxy: ProxyProcess) -> None:
    chat = request(_port(proxy), "POST", "/v1/chat/completions", CHAT)
    assert chat.status == 200 and chat.json()["choices"][0]["message"]["content"] is not None
    part = {"type": "text", "text": "hi"}
    anthropic = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [part]}]}
    assert request(_port(proxy), "POST", "/v1/messages", anthropic).status == 200


# --- malformed HTTP is answered without a traceback per request in the log ------------------------------------------


def test_malformed_http_does_not_flood_the_log(proxy: ProxyProcess) -> None:
    for _ in range(30):
        answer = raw(
            _port(proxy),
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -1\r\n"
            b"Connection: close\r\n\r\n{}",
        )
        assert answer.status == 400
    wait_until(lambda: "malformed HTTP request" in proxy.log(), 15, "the one log line")
    lines = [line for line in proxy.log().splitlines() if "malformed HTTP request" in line]
    assert 1 <= len(lines) < 30, lines
    assert "Traceback" not in proxy.log() and "Error handling request" not in proxy.log()


# --- the path is decided once, on the raw target --------------------------------------------------------------------


def _generated(server: LlamaServer) -> float:
    return server.metrics().get("llamacpp:prompt_tokens_total", 0.0)


@pytest.mark.parametrize(
    ("target", "code"),
    [
        ("/p/%2e%2e/v1/chat/completions", "invalid_path"),
        ("/p/../v1/chat/completions", "invalid_path"),
        ("/p/ok/%2E%2E/v1/chat/completions", "invalid_path"),
        ("/v1/chat%2Fcompletions", "invalid_path"),
        ("/p/-x/v1/chat/completions", "invalid_project"),
        ("/p/%2e%2e/v1/messages", "invalid_path"),
    ],
)
def test_encoded_and_dotted_paths_are_refused_before_llama_server(
    proxy: ProxyProcess, tiny_server: LlamaServer, target: str, code: str
) -> None:
    before = _generated(tiny_server)
    answer = request(_port(proxy), "POST", target, CHAT)
    if target.endswith("/messages"):
        _assert_anthropic_error(answer, 400, "invalid_request_error")
    else:
        _assert_openai_error(answer, 400, code)
    assert _generated(tiny_server) == before  # llama-server never saw it


def test_an_encoded_generating_path_is_treated_as_one(proxy: ProxyProcess) -> None:
    answer = request(_port(proxy), "POST", "/p/enc/v1/chat/completion%73", CHAT)
    assert answer.status == 200
    record = next(r for r in proxy.requests() if r["request_id"] == answer.headers["x-adaptive-spec-request-id"])
    assert (record["api"], record["project"], record["session_id"] is not None) == ("chat", "enc", True)


# --- slot actions belong to the proxy -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "body"),
    [
        ("/slots/0?action=erase", None),
        ("/slots/0?action=save", {"filename": "../../x.bin"}),
        ("/p/x/slots/0?action=restore", {"filename": "x.bin"}),
        ("/models/load", {"model": "other"}),
    ],
)
def test_clients_slot_actions_are_refused(proxy: ProxyProcess, target: str, body: Any) -> None:
    _assert_openai_error(request(_port(proxy), "POST", target, body), 403, "control_endpoint")


def test_the_proxy_erases_slots_and_keeps_its_bookkeeping(proxy: ProxyProcess) -> None:
    assert request(_port(proxy), "GET", "/slots").status == 200  # reading them still passes through
    chat = request(_port(proxy), "POST", "/v1/chat/completions", CHAT, {"x-session-id": "erase-me"})
    assert chat.status == 200

    def placement() -> dict[str, Any]:
        route = http_json(proxy.base + "/adaptive/route")
        return next(p for p in route["placements"] if p["session_id"] == "erase-me")

    assert placement()["in_slot"] is True
    erased = request(_port(proxy), "POST", "/adaptive/profiles/plain/erase")
    assert erased.status == 200 and erased.json()["erased"] == "plain" and erased.json()["slots"] == 1
    assert placement()["in_slot"] is False
    _assert_openai_error(request(_port(proxy), "POST", "/adaptive/profiles/nope/erase"), 404, "unknown_profile")


# --- foreign Host names are refused (DNS rebinding) -----------------------------------------------------------------


def test_a_foreign_host_is_refused(proxy: ProxyProcess) -> None:
    _assert_openai_error(
        request(_port(proxy), "GET", "/adaptive/health", host="attacker.example"), 403, "host_not_allowed"
    )
    _assert_openai_error(
        request(_port(proxy), "POST", "/adaptive/profiles/plain/restart", host="attacker.example:80"),
        403,
        "host_not_allowed",
    )
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    answer = request(_port(proxy), "POST", "/v1/messages", body, host="attacker.example")
    _assert_anthropic_error(answer, 403, "permission_error")
    assert request(_port(proxy), "GET", "/adaptive/health", host="localhost").status == 200
    for method, path in (("GET", "/adaptive/heads"), ("DELETE", "/adaptive/heads")):
        _assert_openai_error(request(_port(proxy), method, path, host="attacker.example"), 403, "host_not_allowed")
    # A page in a browser cannot empty the head store: a foreign Origin on anything but GET/HEAD is refused.
    deleted = request(_port(proxy), "DELETE", "/adaptive/heads", headers={"Origin": "http://evil.example"})
    assert deleted.status == 403, (deleted.status, deleted.body[:200])


# --- no open proxy --------------------------------------------------------------------------------------------------


def test_no_request_makes_the_proxy_contact_another_host(proxy: ProxyProcess) -> None:
    with socket.socket() as canary:
        canary.bind(("127.0.0.1", 0))
        canary.listen(16)
        canary.setblocking(False)
        where = f"127.0.0.1:{canary.getsockname()[1]}"
        port = _port(proxy)
        answers = [
            raw(port, f"GET http://{where}/v1/models HTTP/1.1\r\nHost: {where}\r\nConnection: close\r\n\r\n".encode()),
            raw(port, f"GET //{where}/v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()),
            raw(port, f"CONNECT {where} HTTP/1.1\r\nHost: {where}\r\nConnection: close\r\n\r\n".encode()),
            request(port, "GET", "/v1/models", host=where),
            request(port, "GET", f"/p/%2e%2e/%2e%2e/{where}/v1/models"),
            request(port, "GET", "/v1/models", headers={"x-adaptive-spec-profile": f"http://{where}"}),
            request(port, "POST", "/v1/chat/completions", {**CHAT, "model": f"http://{where}"}),
        ]
        assert all(a.status and a.status < 500 for a in answers), [(a.status, a.body[:100]) for a in answers]
        with pytest.raises(BlockingIOError):
            canary.accept()  # nothing ever connected


# --- the API key, CORS and form posts -------------------------------------------------------------------------------

EVERY_ROUTE = [
    ("GET", "/v1/models"),
    ("GET", "/adaptive/health"),
    ("GET", "/adaptive/requests"),
    ("GET", "/adaptive/events"),
    ("GET", "/adaptive/sessions"),
    ("GET", "/adaptive/route"),
    ("GET", "/adaptive/profiles"),
    ("GET", "/metrics"),
    ("POST", "/adaptive/profiles/plain/restart"),
    ("POST", "/adaptive/profiles/plain/erase"),
    ("POST", "/adaptive/sessions/s1/pin"),
    ("GET", "/adaptive/heads"),
    ("DELETE", "/adaptive/heads"),
    ("DELETE", "/adaptive/heads/0123456789abcdef01234567"),
    ("GET", "/props"),
    ("POST", "/tokenize"),
    ("POST", "/v1/chat/completions"),
]


@pytest.mark.parametrize(("method", "path"), EVERY_ROUTE)
def test_every_route_needs_the_key(keyed: ProxyProcess, method: str, path: str) -> None:
    body = CHAT if method == "POST" else None
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": KEY[:-1]}, {"Authorization": KEY}):
        answer = request(_port(keyed), method, path, body, headers)
        _assert_openai_error(answer, 401, "invalid_api_key")
        assert answer.headers.get("www-authenticate") == "Bearer"


def test_the_key_is_accepted_either_way_and_project_keys_authenticate(keyed: ProxyProcess) -> None:
    port = _port(keyed)
    assert request(port, "GET", "/adaptive/health", headers={"Authorization": f"Bearer {KEY}"}).status == 200
    assert request(port, "GET", "/adaptive/health", headers={"x-api-key": KEY}).status == 200
    chat = request(port, "POST", "/v1/chat/completions", CHAT, {"Authorization": "Bearer sk-project"})
    assert chat.status == 200
    requests = request(port, "GET", "/adaptive/requests", headers={"x-api-key": KEY}).json()["requests"]
    record = next(r for r in requests if r["request_id"] == chat.headers["x-adaptive-spec-request-id"])
    assert record["project"] == "projX"
    messages = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    _assert_anthropic_error(request(port, "POST", "/v1/messages", messages), 401, "authentication_error")
    assert "access: API key required (2 accepted, not sent on to llama-server)" in keyed.log()


def test_hosts_with_a_key(keyed: ProxyProcess) -> None:
    auth = {"x-api-key": KEY}
    assert request(_port(keyed), "GET", "/adaptive/health", headers=auth, host="box.lan:8088").status == 200
    answer = request(_port(keyed), "GET", "/adaptive/health", headers=auth, host="attacker.example")
    _assert_openai_error(answer, 403, "host_not_allowed")


def test_cors_only_for_named_origins(keyed: ProxyProcess, tiny_server: LlamaServer) -> None:
    port, auth = _port(keyed), {"x-api-key": KEY}
    # llama-server reflects any Origin: the proxy must not pass that on.
    direct = request(_upstream_port(tiny_server), "GET", "/props", headers={"Origin": "http://evil.example"})
    assert direct.headers.get("access-control-allow-origin") == "http://evil.example"
    through = request(port, "GET", "/props", headers={**auth, "Origin": "http://evil.example"})
    assert through.status == 200 and not any(h.startswith("access-control-") for h in through.headers)
    preflight = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    answer = request(port, "OPTIONS", "/v1/chat/completions", headers=preflight)  # no key: browsers send none
    assert answer.status == 204
    assert answer.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in answer.headers["access-control-allow-methods"]
    assert answer.headers["access-control-allow-headers"] == "authorization, content-type"
    foreign = request(port, "OPTIONS", "/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
    _assert_openai_error(foreign, 403, "origin_not_allowed")
    allowed = request(port, "POST", "/v1/chat/completions", CHAT, {**auth, "Origin": "https://app.example"})
    assert allowed.status == 200 and allowed.headers["access-control-allow-origin"] == "https://app.example"
    refused = request(port, "POST", "/v1/chat/completions", CHAT, {**auth, "Origin": "http://evil.example"})
    _assert_openai_error(refused, 403, "origin_not_allowed")
    restart = request(port, "POST", "/adaptive/profiles/plain/restart", None, {**auth, "Origin": "null"})
    _assert_openai_error(restart, 403, "origin_not_allowed")


@pytest.mark.parametrize(
    "content_type", ["application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "text/plain;charset=UTF-8"]
)
def test_state_changing_endpoints_refuse_form_posts(keyed: ProxyProcess, content_type: str) -> None:
    for path in ("/adaptive/profiles/plain/restart", "/adaptive/profiles/plain/erase"):
        answer = request(_port(keyed), "POST", path, b"a=1", {"x-api-key": KEY, "Content-Type": content_type})
        _assert_openai_error(answer, 415, "unsupported_media_type")


def test_bench_uses_the_key_and_the_proxys_erase(keyed: ProxyProcess, tmp_path: Path) -> None:
    argv = [
        sys.executable,
        "-m",
        "adaptive_spec",
        "bench",
        "--url",
        keyed.base,
        "--workload",
        "oneshot",
        "--max-tokens",
        "2",
        "--out",
        str(tmp_path),
    ]
    env = {**os.environ, "ADAPTIVE_SPEC_API_KEY": KEY}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert "its slots are erased" in done.stderr and "failed" not in done.stderr, done.stderr


# --- listening beyond loopback --------------------------------------------------------------------------------------


def test_listening_beyond_loopback_without_a_key_is_refused() -> None:
    argv = [
        sys.executable,
        "-m",
        "adaptive_spec",
        "serve",
        "--host",
        "0.0.0.0",
        "--profile",
        "plain=http://127.0.0.1:9",
    ]
    env = {k: v for k, v in os.environ.items() if k != "ADAPTIVE_SPEC_API_KEY"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2
    assert "--api-key" in done.stderr and "--insecure-no-key" in done.stderr, done.stderr


def test_listening_on_all_interfaces_with_a_key_from_the_environment(tiny_server: LlamaServer) -> None:
    proc = ProxyProcess(
        "--host", "0.0.0.0", "--profile", f"plain={tiny_server.url}", env={"ADAPTIVE_SPEC_API_KEY": KEY}
    )
    try:
        assert "access: API key required" in proc.log()
        assert "Host localhost, 127.0.0.1, [::1]" in proc.log()
        _assert_openai_error(request(proc.port, "GET", "/adaptive/health"), 401, "invalid_api_key")
        assert request(proc.port, "GET", "/adaptive/health", headers={"x-api-key": KEY}).status == 200
    finally:
        proc.stop()


# --- router mode: the profile's preset, whatever the client names -------------------------------------------------


@pytest.fixture(scope="module")
def router_url(llama_server_binary: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    home = tmp_path_factory.mktemp("router")
    preset = home / "presets.ini"
    preset.write_text(
        f"[*]\nmodel = {tiny_gguf}\nctx-size = 4096\nthreads = 1\njinja = true\n\n"
        "[plain]\nspec-type = none\n\n[other]\nspec-type = none\n"
    )
    # No model of its own: router mode, its models named by the preset.
    server = LlamaServer(llama_server_binary, None, "--models-preset", str(preset), "--models-max", "2", log_dir=home)
    try:
        yield server.url
    finally:
        server.stop()


def test_a_router_preset_cannot_be_steered_by_the_client(router_url: str) -> None:
    proc = ProxyProcess("--profile", f"plain={router_url}#plain")
    try:
        port = proc.port
        assert request(port, "POST", "/v1/chat/completions", {**CHAT, "model": "other"}).status == 200
        assert request(port, "GET", "/props?model=other").status == 200
        assert request(port, "POST", "/tokenize", {"model": "other", "content": "hi"}).status == 200
        loaded = {m["id"]: m["status"]["value"] for m in http_json(router_url + "/models")["data"]}
        assert loaded["plain"] == "loaded" and loaded["other"] != "loaded", loaded
        _assert_openai_error(request(port, "POST", "/models/load", {"model": "other"}), 403, "control_endpoint")
    finally:
        proc.stop()
