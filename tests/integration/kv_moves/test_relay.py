"""`adaptive-spec kv-relay` as run beside a REAL llama-server (tiny model): key, Host, names, size bound, checksum,
model hash, and the prefill-and-save door the proxy's remote prefill uses."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from adaptive_spec.kv.slot_files import MODEL_HEADER, SHA256_HEADER, file_sha256
from tests.support.processes.relay import RelayProcess, error_of
from tests.support.processes.servers import LlamaServer

KEY = "relay-test-key"
MAX_BYTES = 100_000


@pytest.fixture(scope="module")
def relay(llama_server_binary: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    home = tmp_path_factory.mktemp("relay")
    slots = home / "slots"
    slots.mkdir()
    server = LlamaServer(
        llama_server_binary, tiny_gguf, "-c", "8192", "--slot-save-path", str(slots), log_dir=home / "logs"
    )
    relay = RelayProcess(slots, tiny_gguf, KEY, "--max-bytes", str(MAX_BYTES), server=server.url)
    yield relay, slots, file_sha256(tiny_gguf)
    relay.stop()
    server.stop()


def _put(relay: RelayProcess, name: str, data: bytes, model: str, sha: str | None = None) -> tuple[int, bytes]:
    headers = {MODEL_HEADER: model, SHA256_HEADER: sha or hashlib.sha256(data).hexdigest()}
    status, _, body = relay.call("PUT", f"/relay/slots/{name}", data, headers)
    return status, body


def test_the_model_route_tells_the_gguf_hash_and_every_route_wants_the_key(relay: Any) -> None:
    relay, _, model = relay
    status, _, body = relay.call("GET", "/relay/model")
    assert status == 200 and json.loads(body)["sha256"] == model and json.loads(body)["server"] is True
    routes = [("GET", "/relay/model"), ("GET", "/relay/slots/as-a.bin"), ("DELETE", "/relay/slots/as-a.bin")]
    for method, path in routes:
        status, _, body = relay.call(method, path, key=False)
        assert status == 401 and error_of(body)["code"] == "invalid_api_key"
        status, _, _ = relay.call(method, path, key=False, headers={"Authorization": "Bearer relay-test-kez"})
        assert status == 401
    status, _, body = relay.call("GET", "/relay/model", headers={"Host": "evil.example"})
    assert status == 403 and error_of(body)["code"] == "host_not_allowed"


def test_a_slot_file_goes_up_comes_back_whole_and_is_deleted(relay: Any) -> None:
    relay, slots, model = relay
    data = bytes(range(256)) * 100
    status, body = _put(relay, "as-up_1.bin", data, model)
    assert status == 201, body
    assert (slots / "as-up_1.bin").read_bytes() == data
    status, headers, got = relay.call("GET", "/relay/slots/as-up_1.bin", headers={MODEL_HEADER: model})
    assert status == 200 and got == data
    assert {k.lower(): v for k, v in headers.items()}[SHA256_HEADER] == hashlib.sha256(data).hexdigest()
    assert relay.call("DELETE", "/relay/slots/as-up_1.bin")[0] == 204
    assert not (slots / "as-up_1.bin").exists()
    assert relay.call("GET", "/relay/slots/as-up_1.bin", headers={MODEL_HEADER: model})[0] == 404


@pytest.mark.parametrize("name", ["..", ".hidden", "..%2Fsecret.bin", "a%2Fb.bin", "x" * 129, "sp%20ace.bin"])
def test_names_outside_one_plain_file_are_refused(relay: Any, name: str) -> None:
    relay, slots, model = relay
    (slots.parent / "secret.bin").write_bytes(b"not yours")
    status, _, body = relay.call("GET", f"/relay/slots/{name}", headers={MODEL_HEADER: model})
    assert status in (400, 404), (status, body)  # 404: aiohttp's router never matched a name with a '/'
    assert b"not yours" not in body
    status, _ = _put(relay, name, b"payload", model)
    assert status in (400, 404, 405)
    assert sorted(p.name for p in slots.parent.iterdir()) == ["logs", "secret.bin", "slots"]


def test_too_large_and_corrupt_uploads_leave_nothing_behind(relay: Any) -> None:
    relay, slots, model = relay
    status, body = _put(relay, "as-big.bin", b"x" * (MAX_BYTES + 1), model)
    assert status == 413 and error_of(body)["code"] == "too_large"
    status, body = _put(relay, "as-bad.bin", b"some bytes", model, sha="0" * 64)
    assert status == 422 and error_of(body)["code"] == "checksum_mismatch"
    status, body = _put(relay, "as-none.bin", b"some bytes", model, sha="not-a-hash")
    assert status == 400
    assert list(slots.iterdir()) == []  # no file, no hidden partial file


def test_another_models_kv_is_refused_with_both_hashes_named(relay: Any) -> None:
    relay, slots, model = relay
    other = hashlib.sha256(b"another gguf").hexdigest()
    status, body = _put(relay, "as-foreign.bin", b"kv of another model", other)
    message = error_of(body)["message"]
    assert status == 409 and model in message and other in message, message
    status, _, body = relay.call("GET", "/relay/slots/as-anything.bin", headers={MODEL_HEADER: other})
    assert status == 409
    assert relay.call("GET", "/relay/slots/as-anything.bin")[0] == 400  # no hash named at all
    assert list(slots.iterdir()) == []


def test_prefill_saves_the_servers_slot_for_download(relay: Any) -> None:
    relay, _, model = relay
    spec = {
        "path": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "tell me " * 200}], "max_tokens": 50, "stream": True},
        "filename": "as-pp-test.bin",
    }
    headers = {MODEL_HEADER: model, "Content-Type": "application/json"}
    status, _, body = relay.call("POST", "/relay/prefill", json.dumps(spec).encode(), headers)
    answer = json.loads(body)
    assert status == 200, answer
    assert answer["timings"]["prompt_n"] + answer["timings"]["cache_n"] == answer["n_saved"] > 1000
    assert answer["timings"]["predicted_n"] == 1  # what was asked for: the prompt, not the 50 tokens
    status, _, data = relay.call("GET", "/relay/slots/as-pp-test.bin", headers={MODEL_HEADER: model})
    assert status == 200 and len(data) == answer["n_written"]
    assert relay.call("DELETE", "/relay/slots/as-pp-test.bin")[0] == 204
    spec["path"] = "/slots/0?action=erase"
    status, _, body = relay.call("POST", "/relay/prefill", json.dumps(spec).encode(), headers)
    assert status == 400 and error_of(body)["code"] == "bad_prefill"


def test_links_fifos_and_folders_in_the_slot_dir_are_not_slot_files(relay: Any) -> None:
    relay, slots, model = relay
    outside = slots.parent / "private.txt"
    outside.write_bytes(b"the relay's user's secret")
    (slots / "as-link.bin").symlink_to(outside)
    os.mkfifo(slots / "as-fifo.bin")  # opened for reading, a FIFO would hold the download until a writer came
    (slots / "as-dir.bin").mkdir()
    try:
        for name in ("as-link.bin", "as-fifo.bin", "as-dir.bin"):
            status, _, body = relay.call("GET", f"/relay/slots/{name}", headers={MODEL_HEADER: model})
            assert status == 404 and error_of(body)["code"] == "not_found", (name, body)
        assert relay.call("DELETE", "/relay/slots/as-dir.bin")[0] == 404
        assert relay.call("DELETE", "/relay/slots/as-fifo.bin")[0] == 404
        assert relay.call("DELETE", "/relay/slots/as-link.bin")[0] == 204  # the link goes, not what it points to
        assert outside.read_bytes() == b"the relay's user's secret"
        status, body = _put(relay, "as-dir.bin", b"payload", model)
        error = error_of(body)
        assert status == 500 and error["code"] == "io" and str(slots) not in error["message"], error
    finally:
        (slots / "as-fifo.bin").unlink()
        (slots / "as-dir.bin").rmdir()
    assert list(slots.iterdir()) == []


def test_slot_files_adaptive_spec_did_not_name_are_neither_served_taken_nor_deleted(relay: Any) -> None:
    relay, slots, model = relay
    theirs = slots / "someones-chat.bin"  # saved by another user of the same llama-server: their prompt's tokens
    theirs.write_bytes(b"their conversation")
    try:
        assert relay.call("GET", "/relay/slots/someones-chat.bin", headers={MODEL_HEADER: model})[0] == 400
        assert relay.call("DELETE", "/relay/slots/someones-chat.bin")[0] == 400
        status, body = _put(relay, "someones-chat.bin", b"overwritten", model)
        assert status == 400 and error_of(body)["code"] == "bad_name"
        assert theirs.read_bytes() == b"their conversation"
    finally:
        theirs.unlink()


def test_a_name_ending_in_a_newline_is_refused(relay: Any) -> None:
    relay, slots, model = relay
    status, body = _put(relay, "as-nl.bin%0A", b"payload", model)
    assert status == 400 and error_of(body)["code"] == "bad_name"
    assert list(slots.iterdir()) == []


def test_refusals_of_the_web_framework_are_openai_shaped_too(relay: Any) -> None:
    relay, _, _ = relay
    status, _, body = relay.call("GET", "/relay/nothing-here")
    assert status == 404 and error_of(body)["code"] == "http_404"
    status, _, body = relay.call("POST", "/relay/model", b"{}")
    assert status == 405 and error_of(body)["code"] == "http_405"
    status, _, body = relay.call("GET", "/relay/nothing-here", key=False)
    assert status == 401  # the key first, even to say there is nothing here


def test_an_upload_cut_off_midway_leaves_no_partial_file(relay: Any) -> None:
    relay, slots, model = relay
    head = (
        f"PUT /relay/slots/as-cut.bin HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {relay.key}\r\n"
        f"{MODEL_HEADER}: {model}\r\n{SHA256_HEADER}: {'0' * 64}\r\nContent-Length: {MAX_BYTES}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", relay.port)) as sock:
        sock.sendall(head.encode() + b"x" * (MAX_BYTES // 2))
        _wait_for(lambda: any(p.name.startswith(".part-") for p in slots.iterdir()))
    _wait_for(lambda: list(slots.iterdir()) == [])  # the relay noticed the hang-up and removed its partial file


def test_prefill_requests_are_bounded_and_must_be_objects(relay: Any) -> None:
    relay, _, model = relay
    headers = {MODEL_HEADER: model, "Content-Type": "application/json"}
    status, _, body = relay.call("POST", "/relay/prefill", b"[1, 2]", headers)
    assert status == 400 and error_of(body)["code"] == "bad_prefill"
    big = b'{"path": "/v1/completions", "filename": "as-x.bin", "body": {"prompt": "' + b"a" * (33 << 20) + b'"}}'
    status, _, body = relay.call("POST", "/relay/prefill", big, headers)
    assert status == 413 and error_of(body)["code"] == "too_large"


def test_the_key_appears_in_no_line_the_relay_writes(relay: Any) -> None:
    relay, _, _ = relay
    relay.call("GET", "/relay/model", headers={"Authorization": f"Bearer {relay.key}x"}, key=False)
    relay.call("GET", "/relay/slots/as-none.bin")
    assert relay.lines and not any(relay.key in line for line in relay.lines)


def _wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Polls (a wait for the other process, not a timing assertion): fails only if it never happens."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.05)


def test_concurrent_uploads_of_one_name_leave_one_of_them_whole(relay: Any) -> None:
    relay, slots, model = relay
    payloads = [bytes([n]) * 90_000 for n in range(6)]
    with ThreadPoolExecutor(len(payloads)) as pool:
        statuses = list(pool.map(lambda data: _put(relay, "as-same.bin", data, model)[0], payloads))
    assert statuses == [201] * len(payloads)
    assert (slots / "as-same.bin").read_bytes() in payloads  # the last rename wins; never a mix
    assert relay.call("DELETE", "/relay/slots/as-same.bin")[0] == 204
    assert list(slots.iterdir()) == []
