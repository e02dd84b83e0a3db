from __future__ import annotations

import pytest

from adaptive_spec.requests.apis import Api
from adaptive_spec.requests.body.parse import ParsedRequest, parse_body, split_path
from adaptive_spec.requests.body.shapes import RequestProblem


@pytest.mark.parametrize(
    ("path", "project", "upstream", "api"),
    [
        ("/v1/chat/completions", None, "/v1/chat/completions", "chat"),
        ("/p/projA/v1/chat/completions", "projA", "/v1/chat/completions", "chat"),
        ("/p/my.proj-2/v1/responses", "my.proj-2", "/v1/responses", "responses"),
        ("/p/x/v1/messages", "x", "/v1/messages", "messages"),
        ("/v1/completions", None, "/v1/completions", "completions"),
        ("/p/x/v1/models", "x", "/v1/models", "models"),
        ("/slots", None, "/slots", "other"),
        ("/p/x", "x", "/", "other"),
        ("/p//v1/models", None, "/p//v1/models", "other"),
    ],
)
def test_split_path(path: str, project: str | None, upstream: str, api: str) -> None:
    routed = split_path(path)
    assert (routed.project, routed.upstream_path, routed.api) == (project, upstream, api)


def test_valid_chat_request() -> None:
    parsed = parse_body(Api.CHAT, b'{"model": "m", "messages": [], "stream": true, "temperature": 0}')
    assert isinstance(parsed, ParsedRequest)
    assert parsed.stream and parsed.model == "m"


@pytest.mark.parametrize(
    ("api", "body", "code", "param", "words"),
    [
        ("chat", b"{not json", "invalid_json", None, "not valid JSON"),
        ("chat", b"[1, 2]", "invalid_type", None, "must be a JSON object, not an array"),
        ("chat", b'{"model": "m"}', "missing_required_parameter", "messages", "'messages' is a required"),
        ("chat", b'{"messages": "hi"}', "invalid_type", "messages", "expected an array, but got a string"),
        ("chat", b'{"messages": [], "stream": "yes"}', "invalid_type", "stream", "expected a boolean"),
        ("chat", b'{"messages": [], "max_tokens": 1.5}', "invalid_type", "max_tokens", "expected an integer"),
        ("chat", b'{"messages": [], "max_tokens": true}', "invalid_type", "max_tokens", "got a boolean"),
        ("chat", b'{"messages": [], "temperature": "0"}', "invalid_type", "temperature", "expected a number"),
        ("chat", b'{"messages": [], "model": 3}', "invalid_type", "model", "expected a string"),
        ("completions", b'{"prompt": 5}', "invalid_type", "prompt", "a string or an array"),
        ("responses", b'{"model": "m"}', "missing_required_parameter", "input", "'input'"),
        ("messages", b'{"messages": {}}', "invalid_type", "messages", "expected an array"),
    ],
)
def test_bad_requests(api: str, body: bytes, code: str, param: str | None, words: str) -> None:
    problem = parse_body(Api(api), body)
    assert isinstance(problem, RequestProblem)
    assert (problem.code, problem.param) == (code, param)
    assert words in problem.message
