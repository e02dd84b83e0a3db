"""`adaptive-spec kv-relay` as run beside a REAL llama-server (tiny model): key, Host, names, size bound, checksum,
model hash, and the prefill-and-save door the proxy's remote prefill uses."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from adaptive_spec.core.slot_files import MODEL_HEADER, SHA256_HEADER
from adaptive_spec.relay.model_hash import file_sha256
from tests.support.relay import RelayProcess, error_of
from tests.support.servers import LlamaServer

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
    for method, path in [("GET", "/relay/model"), ("GET", "/relay/slots/a.bin"), ("DELETE", "/relay/slots/a.bin")]:
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
    status, body = _put(relay, "big.bin", b"x" * (MAX_BYTES + 1), model)
    assert status == 413 and error_of(body)["code"] == "too_large"
    status, body = _put(relay, "bad.bin", b"some bytes", model, sha="0" * 64)
    assert status == 422 and error_of(body)["code"] == "checksum_mismatch"
    status, body = _put(relay, "none.bin", b"some bytes", model, sha="not-a-hash")
    assert status == 400
    assert list(slots.iterdir()) == []  # no file, no hidden partial file


def test_another_models_kv_is_refused_with_both_hashes_named(relay: Any) -> None:
    relay, slots, model = relay
    other = hashlib.sha256(b"another gguf").hexdigest()
    status, body = _put(relay, "foreign.bin", b"kv of another model", other)
    message = error_of(body)["message"]
    assert status == 409 and model in message and other in message, message
    status, _, body = relay.call("GET", "/relay/slots/anything.bin", headers={MODEL_HEADER: other})
    assert status == 409
    assert relay.call("GET", "/relay/slots/anything.bin")[0] == 400  # no hash named at all
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
