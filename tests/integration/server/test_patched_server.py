"""The patched llama-server itself (src/adaptive_spec/llama/binary/patches/), with no proxy in front: per-request
`speculative.n_max` and `speculative.types` on an ngram-mod server and on model-drafter + ngram-mod servers (tiny
random-weight DFlash and MTP), the 400s for values outside the server's settings, `/props`' field, the per-type
draft counts, and that a request naming nothing is served as before.

A random drafter accepts what it accepts: these tests assert who drafted and that it was counted, never a rate.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.models.tiny_drafters import write_tiny_dflash, write_tiny_mtp_target
from tests.support.processes.servers import LlamaServer, http_json

# Small n-gram settings so the tiny model's looping output is drafted from within a few dozen tokens.
NGRAM = ["--spec-ngram-mod-n-match", "8", "--spec-ngram-mod-n-min", "4", "--spec-ngram-mod-n-max", "16"]
PROMPT = [{"role": "user", "content": " ".join(["abc"] * 24)}]


def chat(server: LlamaServer, fields: dict[str, Any] | None = None, max_tokens: int = 48) -> dict[str, Any]:
    body = {"messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "seed": 1, **(fields or {})}
    return dict(http_json(server.url + "/v1/chat/completions", body))


def refused(server: LlamaServer, fields: dict[str, Any]) -> tuple[int, str]:
    body = {"messages": PROMPT, "max_tokens": 4, "temperature": 0, **fields}
    req = urllib.request.Request(
        server.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(req, timeout=60)
    return caught.value.code, str(json.loads(caught.value.read())["error"]["message"])


def drafted(reply: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Drafted and accepted tokens per speculative type, checked against the totals the response also gives."""
    timings = reply["timings"]
    by_type = {k: (int(v["draft_n"]), int(v["draft_n_accepted"])) for k, v in timings.get("draft_by_type", {}).items()}
    assert sum(n for n, _ in by_type.values()) == timings.get("draft_n", 0)
    assert sum(a for _, a in by_type.values()) == timings.get("draft_n_accepted", 0)
    return by_type


@pytest.fixture(scope="module")
def ngram_server(
    llama_server_binary: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    logs = tmp_path_factory.mktemp("ngram-logs")
    server = LlamaServer(llama_server_binary, tiny_gguf, "-c", "4096", "--spec-type", "ngram-mod", *NGRAM, log_dir=logs)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plain_server(
    llama_server_binary: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    server = LlamaServer(llama_server_binary, tiny_gguf, "-c", "4096", log_dir=tmp_path_factory.mktemp("plain-logs"))
    yield server
    server.stop()


def test_props_say_what_a_request_may_choose(ngram_server: LlamaServer, plain_server: LlamaServer) -> None:
    assert http_json(ngram_server.url + "/props")["speculative_per_request"] == {"types": ["ngram-mod"], "n_max": 16}
    assert http_json(plain_server.url + "/props")["speculative_per_request"] == {"types": [], "n_max": 0}


def test_n_max_0_and_an_empty_type_list_draft_nothing_where_the_server_would(ngram_server: LlamaServer) -> None:
    assert drafted(chat(ngram_server)).keys() == {"ngram-mod"}  # the server's own: it drafts
    assert drafted(chat(ngram_server, {"speculative.n_max": 0})) == {}
    assert drafted(chat(ngram_server, {"speculative.types": []})) == {}
    assert drafted(chat(ngram_server, {"speculative.types": "none"})) == {}
    assert drafted(chat(ngram_server, {"speculative.types": "ngram-mod"})).keys() == {"ngram-mod"}


def test_a_cap_shortens_every_draft(ngram_server: LlamaServer) -> None:
    """The same looping reply drafted in steps of up to 2 tokens instead of up to 16: fewer tokens drafted."""
    capped = chat(ngram_server, {"speculative.n_max": 2}, max_tokens=64)["timings"]
    uncapped = chat(ngram_server, max_tokens=64)["timings"]
    assert 0 < capped["draft_n"] < uncapped["draft_n"]


def test_values_outside_the_server_s_settings_are_a_400_naming_the_allowed_ones(
    ngram_server: LlamaServer, plain_server: LlamaServer
) -> None:
    code, message = refused(ngram_server, {"speculative.n_max": 17})
    assert code == 400 and "0 <= value <= 16" in message
    code, message = refused(ngram_server, {"speculative.types": ["draft-dflash"]})
    assert code == 400 and "'draft-dflash'" in message and "allowed: ngram-mod" in message
    code, message = refused(ngram_server, {"speculative.types": ["no-such-type"]})
    assert code == 400 and "'no-such-type'" in message
    code, message = refused(ngram_server, {"speculative.types": 3})
    assert code == 400 and "array" in message
    code, message = refused(plain_server, {"speculative.types": ["ngram-mod"]})
    assert code == 400 and "allowed: none" in message
    code, message = refused(plain_server, {"speculative.n_max": 1})
    assert code == 400 and "0 <= value <= 0" in message


def test_n_gram_off_decodes_as_a_server_without_speculation(
    ngram_server: LlamaServer, plain_server: LlamaServer
) -> None:
    """With nothing drafted, every token is decoded alone, as on a server started without speculation: the same greedy
    text (drafting itself may change the arithmetic of batched verification, so only the off request is compared)."""
    off = chat(ngram_server, {"speculative.types": []}, max_tokens=64)
    plain = chat(plain_server, max_tokens=64)
    assert off["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert plain["timings"].get("draft_n", 0) == 0


@pytest.fixture(scope="module", params=["dflash", "mtp"])
def drafter_server(
    request: pytest.FixtureRequest, llama_server_binary: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, LlamaServer]]:
    """A model drafter and ngram-mod on one server, as `serve --draft-type` launches it."""
    home = tmp_path_factory.mktemp(f"{request.param}-server")
    if request.param == "dflash":
        drafter = write_tiny_dflash(home / "tiny-random-dflash.gguf")
        model, extra = tiny_gguf, ["-md", str(drafter), "-fa", "on"]
    else:  # MTP drafts with the target's own heads
        model, extra = write_tiny_mtp_target(home / "tiny-random-qwen35-mtp.gguf"), []
    spec = f"draft-{request.param}"
    server = LlamaServer(
        llama_server_binary,
        model,
        "-c",
        "4096",
        "--spec-type",
        f"{spec},ngram-mod",
        "--spec-draft-n-max",
        "4",
        *NGRAM,
        *extra,
        log_dir=home / "logs",
    )
    yield spec, server
    server.stop()


def test_each_drafter_can_be_chosen_alone_on_one_server(drafter_server: tuple[str, LlamaServer]) -> None:
    spec, server = drafter_server
    props = http_json(server.url + "/props")["speculative_per_request"]
    assert set(props["types"]) == {spec, "ngram-mod"}
    assert drafted(chat(server, {"speculative.types": [spec]})).keys() == {spec}
    assert set(drafted(chat(server, {"speculative.types": ["ngram-mod"]}))) <= {"ngram-mod"}
    assert drafted(chat(server, {"speculative.n_max": 0})) == {}
    assert drafted(chat(server)).keys() <= {spec, "ngram-mod"}


def test_a_drafter_turned_off_for_a_turn_drafts_again_on_the_next(drafter_server: tuple[str, LlamaServer]) -> None:
    """on / off / on in one conversation on one slot: the skipped drafter still saw every batch, so the third turn
    drafts and is verified like the first (no crash, no re-prefill of the shared prefix)."""
    spec, server = drafter_server
    only = {"speculative.types": [spec]}
    messages: list[dict[str, str]] = list(PROMPT)
    counts = []
    for fields in (only, {"speculative.n_max": 0}, only):
        body = {"messages": messages, "max_tokens": 24, "temperature": 0, "seed": 1, **fields}
        reply = http_json(server.url + "/v1/chat/completions", body)
        counts.append(drafted(reply))
        messages = [*messages, reply["choices"][0]["message"], {"role": "user", "content": "abc abc abc"}]
        if len(counts) > 1:
            assert reply["timings"]["cache_n"] > 0, "the conversation's prefix was kept"
    assert counts[1] == {}
    assert counts[0].keys() == {spec} and counts[2].keys() == {spec}
