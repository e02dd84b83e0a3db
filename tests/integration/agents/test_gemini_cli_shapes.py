"""Gemini CLI's request shapes (synthetic bodies of their structure in tests/data/agent-shapes/gemini-cli/: its router's
classifier, a first turn, a tool turn, its next-speaker check and its chat compression) through the proxy to a REAL
llama-server (tiny model), and their translations sent to it directly: wherever llama-server answers the chat
completion 2xx, the proxy answers the Gemini request 200, and where it refuses it, the proxy says so with its status.
And its first turn grouped: the classifier and the conversation that follows it, neither naming a session, are one
session, named as Gemini CLI's."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from adaptive_spec.requests.gemini.request import Translated, gemini_target, to_chat
from tests.support.gemini import sse_chunks
from tests.support.processes.servers import LlamaServer, ProxyProcess, http_json, wait_until

SHAPES = Path(__file__).resolve().parents[2] / "data" / "agent-shapes" / "gemini-cli"
USER_AGENT = "GeminiCLI/0.61.0/gemini-3.1-pro-preview (linux; x64)"


def _shapes() -> list[tuple[str, dict[str, Any]]]:
    found = [(p.stem, json.loads(p.read_text())) for p in sorted(SHAPES.glob("*.json"))]
    assert len(found) >= 5, f"Gemini CLI's shapes are missing from {SHAPES}"
    return found


@pytest.fixture(scope="module")
def proxy(tiny_server: LlamaServer) -> Iterator[ProxyProcess]:
    proc = ProxyProcess("--profile", f"plain={tiny_server.url}")
    yield proc
    proc.stop()


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    headers = {"Content-Type": "application/json", "User-Agent": USER_AGENT, "x-goog-api-key": "local"}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def _direct(server: LlamaServer, shape: dict[str, Any]) -> tuple[int, bytes]:
    """The shape's translation, sent to llama-server's chat completions as the proxy would (not streamed)."""
    target = gemini_target(f"/v1beta/models/{shape['model']}:{shape['method'].split('?')[0]}")
    assert target is not None
    translated = to_chat(json.dumps(shape["body"]).encode(), target)
    assert isinstance(translated, Translated), translated
    chat = {**translated.chat, "stream": False}
    req = urllib.request.Request(
        server.url + "/v1/chat/completions",
        data=json.dumps(chat).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


@pytest.mark.parametrize(("name", "shape"), _shapes(), ids=[name for name, _ in _shapes()])
def test_each_shape_is_answered_where_llama_server_answers_its_translation(
    proxy: ProxyProcess, tiny_server: LlamaServer, name: str, shape: dict[str, Any]
) -> None:
    direct, said = _direct(tiny_server, shape)
    status, _, data = _post(f"{proxy.base}/p/shapes/v1beta/models/{shape['model']}:{shape['method']}", shape["body"])
    if not 200 <= direct < 300:
        # The tiny model's vocabulary takes no JSON-schema grammar ("Failed to initialize samplers"): the proxy says
        # llama-server's answer, in Google's shape (the embedded Qwen answers Gemini CLI's classifier 200: the e2e).
        assert status == direct and json.loads(data)["error"]["code"] == direct, (name, said[:300], data[:300])
        return
    assert status == 200, (name, data[:500])
    chunks = sse_chunks(data) if shape["method"].endswith("alt=sse") else [json.loads(data)]
    assert chunks[-1]["candidates"][0].get("finishReason"), (name, chunks[-1])


def test_the_classifier_and_the_first_turn_after_it_are_one_session(proxy: ProxyProcess) -> None:
    shapes = dict(_shapes())
    classifier = json.loads(json.dumps(shapes["classifier"]))
    for key in ("responseMimeType", "responseJsonSchema"):  # a grammar the tiny model cannot take (above)
        classifier["body"]["generationConfig"].pop(key)
    first_turn = json.loads(json.dumps(shapes["first-turn"]))
    # An opening of their own: the shapes above were sent already (one refused, which a retry would join).
    classifier["body"]["contents"][-1]["parts"][-1]["text"] = first_turn["body"]["contents"][-1]["parts"][-1][
        "text"
    ] = "Create bye.py that prints bye."
    ids = []
    for shape in (classifier, first_turn):
        status, headers, data = _post(
            f"{proxy.base}/p/grouped/v1beta/models/{shape['model']}:{shape['method']}", shape["body"]
        )
        assert status == 200, data[:500]
        ids.append(headers["x-adaptive-spec-request-id"])

    def found() -> list[dict[str, Any]]:
        listed = http_json(f"{proxy.base}/adaptive/requests?limit=100")["requests"]
        return [r for r in listed if r["request_id"] in ids]

    wait_until(lambda: len(found()) == 2, 10, "both records")
    by_id = {r["request_id"]: r for r in found()}
    classifier, first = by_id[ids[0]], by_id[ids[1]]
    assert (classifier["session_source"], first["session_source"]) == ("new", "opening")
    assert classifier["session_id"] == first["session_id"]
    assert {classifier["client"], first["client"]} == {"gemini-cli"}
    assert (classifier["model"], first["model"]) == ("gemini-3.5-flash-lite", "gemini-3.1-pro-preview")
