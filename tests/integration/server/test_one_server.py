"""Profiles as per-request settings of ONE llama-server, on the REAL patched llama-server (tiny models): `serve`
launches one server, a session alternating profiles keeps its slot's cache (no save, no restore), n-gram off drafts
nothing, the settings reach chat/completions and /v1/responses, a client's own fields win and are recorded; a server
the probe finds stock gets one server per profile; attached profiles naming one patched server share it; the tiny
hybrid (qwen35) target keeps its prefix across a switch.

The stock server is simulated: tests/support/fakes/stock_props.py puts a pass-through in front of the patched server
that removes `speculative_per_request` from /props (everything else passes as it came), so the probe sees a stock build.
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.models.tiny_drafters import write_tiny_mtp_target
from tests.support.models.tiny_policy import tiny_policy
from tests.support.processes.servers import LlamaServer, ProxyProcess, chat_record, free_port, http_json, wait_until

STOCK_PROPS = Path(__file__).resolve().parents[2] / "support" / "fakes" / "stock_props.py"
PASTED = "Here is a.py:\n```python\n" + "\n".join(f"value_{i} = {i} * {i}" for i in range(60)) + "\n```\nWhat is it?"
REPEATS = [{"role": "user", "content": "abc abc abc abc abc abc abc abc abc abc abc abc"}]
ONE_SERVER = "profiles: one llama-server, speculation per request"
STOCK = "profiles: one llama-server per profile (stock llama-server without per-request speculation)"


@pytest.fixture(scope="module")
def patched_binary(llama_server_binary: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The llama-server in use, when it takes speculation per request (its /props says so)."""
    server = LlamaServer(llama_server_binary, tiny_gguf, "-c", "2048", log_dir=tmp_path_factory.mktemp("logs"))
    try:
        props = http_json(server.url + "/props")
    finally:
        server.stop()
    if "speculative_per_request" not in props:
        what = f"{llama_server_binary} does not take speculation per request (build the patched one)"
        if os.environ.get("CI"):
            pytest.fail(what)
        pytest.skip(what)
    return llama_server_binary


def _env(home: Path, binary: str) -> dict[str, str]:
    return {
        "ADAPTIVE_SPEC_STATE_DIR": str(home / "state"),
        "ADAPTIVE_SPEC_CONFIG_DIR": str(home / "config"),
        "ADAPTIVE_SPEC_LLAMA_SERVER": binary,
    }


def _serve(home: Path, binary: str, model: Path, *extra: str) -> ProxyProcess:
    args = ("--model", str(model), "--threads", "1", "--ctx-size", "8192", "--ngram-mod", "8,8,16", *extra)
    return ProxyProcess(*args, env=_env(home, binary))


@pytest.fixture(scope="module")
def one(patched_binary: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    proxy = _serve(tmp_path_factory.mktemp("one-server"), patched_binary, tiny_gguf)
    yield proxy
    proxy.stop()


def _alternate(proxy: ProxyProcess, session: str, profiles: list[str]) -> list[dict[str, Any]]:
    history: list[dict[str, str]] = [{"role": "user", "content": f"Session {session}.\n{PASTED}"}]
    records = []
    for turn, profile in enumerate(profiles):
        record = chat_record(proxy, history, 24, **{"x-session-id": session, "x-adaptive-spec-profile": profile})
        records.append(record)
        history += [{"role": "assistant", "content": record["text"]}, {"role": "user", "content": f"And {turn}?"}]
    return records


def test_serve_launches_one_server_for_both_profiles(one: ProxyProcess) -> None:
    log = one.log()
    assert ONE_SERVER in log and log.count("starting profile") == 1, log
    profiles = {p["name"]: p["base_url"] for p in http_json(one.base + "/adaptive/profiles")["profiles"]}
    assert profiles["oneshot"] == profiles["iterative"]
    assert "per-request: types=none" in log and "per-request: the server's own" in log


def test_a_session_alternating_profiles_keeps_its_cache_with_no_handoff(one: ProxyProcess) -> None:
    records = _alternate(one, "alternating", ["oneshot", "iterative", "oneshot", "iterative"])
    for before, after in itertools.pairwise(records):
        context = before["timings"]["cache_n"] + before["timings"]["prompt_n"]
        assert after["moved_from"] == before["profile"] and after["handoff"] is None, after
        assert "same server" in after["reason"], after["reason"]
        # The whole previous prompt is reused in the same slot (the reply re-tokenizes at most a few tokens apart).
        assert after["timings"]["cache_n"] >= context - 8, (before["timings"], after["timings"])
    assert [r["speculation"] for r in records[:2]] == [{"types": [], "n_max": None, "set_by": "profile"}, None]
    assert http_json(one.base + "/adaptive/route")["handoffs"] == {"ok": 0, "failed": 0}


def _drafted(proxy: ProxyProcess) -> int:
    req = urllib.request.Request(proxy.base + "/metrics", headers={"x-adaptive-spec-profile": "iterative"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    line = next(x for x in text.splitlines() if x.startswith("llamacpp:spec_decode_num_draft_tokens_total"))
    return int(float(line.split()[-1]))


def _post(proxy: ProxyProcess, path: str, body: dict[str, Any], profile: str) -> dict[str, Any]:
    req = urllib.request.Request(
        proxy.base + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "x-adaptive-spec-profile": profile},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        request_id = resp.headers["x-adaptive-spec-request-id"]
        resp.read()
    return next(r for r in proxy.requests() if r["request_id"] == request_id)


def test_ngram_off_drafts_nothing_on_the_ngram_server(one: ProxyProcess) -> None:
    body = {"messages": REPEATS, "max_tokens": 200, "temperature": 0}
    on = _post(one, "/v1/chat/completions", body, "iterative")
    off = _post(one, "/v1/chat/completions", body, "oneshot")
    assert on["timings"]["draft_n"] > 0, on["timings"]  # the tiny model repeats itself: ngram-mod drafts
    assert off["timings"]["draft_n"] == 0 and off["speculation"]["types"] == [], off
    # A client's own field wins over the profile's, and the record says who set it.
    mine = _post(one, "/v1/chat/completions", {**body, "speculative.types": ["ngram-mod"]}, "oneshot")
    assert mine["timings"]["draft_n"] > 0 and mine["speculation"]["set_by"] == "client", mine
    # /v1/responses carries the settings too (its answer has no timings: llama-server's own counters tell).
    before = _drafted(one)
    responses = _post(
        one, "/v1/responses", {"input": REPEATS[0]["content"], "max_output_tokens": 200, "temperature": 0}, "oneshot"
    )
    assert responses["speculation"]["types"] == [] and _drafted(one) == before
    # And /v1/messages (the patched server's Anthropic conversion passes them on).
    before = _drafted(one)
    messages = {"model": "m", "messages": REPEATS, "max_tokens": 200, "temperature": 0}
    anthropic = _post(one, "/v1/messages", messages, "oneshot")
    assert anthropic["speculation"]["types"] == [] and _drafted(one) == before
    _post(one, "/v1/messages", messages, "iterative")
    assert _drafted(one) > before, "the same request with the server's own settings drafts"


def _wrapper(folder: Path, binary: str) -> Path:
    """A --llama-server that starts the patched one behind the pass-through that hides it (tests/support)."""
    wrapper = folder / "stock-llama-server"
    command = shlex.join([sys.executable, str(STOCK_PROPS), "wrap", binary])
    wrapper.write_text(f'#!/bin/sh\nexec {command} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def test_a_server_the_probe_finds_stock_gets_one_server_per_profile(
    patched_binary: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    home = tmp_path_factory.mktemp("stock")
    wrapper, policy = str(_wrapper(home, patched_binary)), str(tiny_policy(home))  # the move below pays
    proxy = _serve(home, patched_binary, tiny_gguf, "--llama-server", wrapper, "--policy", policy)
    try:
        log = proxy.log()
        assert STOCK in log and log.count("starting profile") == 2, log
        profiles = {p["name"]: p["base_url"] for p in http_json(proxy.base + "/adaptive/profiles")["profiles"]}
        assert profiles["oneshot"] != profiles["iterative"]
        records = _alternate(proxy, "stock", ["oneshot", "iterative"])
        assert records[1]["moved_from"] == "oneshot" and records[1]["handoff"]["ok"], records[1]  # today's design
        assert records[0]["speculation"] is None  # nothing is named to a server that would not take it
    finally:
        proxy.stop()


@pytest.fixture(scope="module")
def attached(
    patched_binary: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, Path]]:
    """A patched server, and the same server behind the pass-through that makes it look stock."""
    home = tmp_path_factory.mktemp("attached")
    server = LlamaServer(
        patched_binary, tiny_gguf, "-c", "4096", "--spec-type", "ngram-mod", "--metrics", log_dir=home / "logs"
    )
    port = free_port()
    hider = subprocess.Popen([sys.executable, str(STOCK_PROPS), "serve", str(port), server.url])
    stock = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(stock + "/health"), 30, "the pass-through")
        yield server.url, stock, home
    finally:
        hider.terminate()
        hider.wait(10)
        server.stop()


def _answers(url: str) -> bool:
    try:
        http_json(url)
    except OSError:
        return False
    return True


def test_attached_profiles_naming_one_patched_server_share_it(attached: tuple[str, str, Path]) -> None:
    patched, _, home = attached
    args = ("--profile", f"oneshot={patched};types=none", "--profile", f"iterative={patched}", "--tokenizer", "off")
    proxy = ProxyProcess(*args, env={"ADAPTIVE_SPEC_STATE_DIR": str(home / "state")})
    try:
        assert f"  oneshot, iterative: one llama-server, speculation per request at {patched}" in proxy.log()
        records = _alternate(proxy, "attached", ["oneshot", "iterative"])
        assert records[1]["handoff"] is None and "same server" in records[1]["reason"], records[1]
        assert records[0]["speculation"]["types"] == []
    finally:
        proxy.stop()


def test_attached_stock_servers_keep_their_meaning(attached: tuple[str, str, Path]) -> None:
    _, stock, home = attached
    env = {"ADAPTIVE_SPEC_STATE_DIR": str(home / "state")}
    proxy = ProxyProcess("--profile", f"a={stock}", "--profile", f"b={stock}", "--tokenizer", "off", env=env)
    try:
        assert "speculation per request" not in proxy.log()  # two profiles, two servers as far as routing goes
    finally:
        proxy.stop()
    argv = [sys.executable, "-m", "adaptive_spec", "serve", "--port", str(free_port()), "--tokenizer", "off"]
    argv += ["--profile", f"oneshot={stock};types=none", "--profile", f"iterative={stock}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert done.returncode != 0
    assert "does not take them per request (a stock llama-server)" in done.stderr, done.stderr


def test_the_hybrid_target_keeps_its_prefix_across_a_switch(
    patched_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The tiny qwen35 target (a recurrent layer beside attention, as in Qwen3.5/3.6): on one server the slot and its
    checkpoints stay, and the prefix is reused (between two servers b11549's slot files carry the checkpoints too:
    test_drafters.py)."""
    home = tmp_path_factory.mktemp("hybrid")
    model = write_tiny_mtp_target(home / "tiny-random-qwen35-mtp.gguf")
    proxy = _serve(home, patched_binary, model, "--draft-type", "mtp")
    try:
        assert ONE_SERVER in proxy.log() and "--spec-type draft-mtp,ngram-mod" in proxy.log()
        first, second = _alternate(proxy, "hybrid", ["oneshot", "iterative"])
        context = first["timings"]["prompt_n"] + first["timings"]["cache_n"]
        assert first["speculation"]["types"] == ["draft-mtp"]
        assert second["handoff"] is None and second["timings"]["cache_n"] > context // 2, second["timings"]
    finally:
        proxy.stop()


def test_erasing_a_profile_waits_for_every_request_on_its_server(one: ProxyProcess) -> None:
    """oneshot and iterative are one server: erasing oneshot while an iterative request runs would empty that
    request's slot under it, so it is refused (409) until the server is idle."""
    erase = urllib.request.Request(
        one.base + "/adaptive/profiles/oneshot/erase", data=b"{}", headers={"Content-Type": "application/json"}
    )
    body = {"messages": REPEATS, "max_tokens": 4000, "temperature": 0, "stream": True}
    req = urllib.request.Request(
        one.base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "x-adaptive-spec-profile": "iterative"},
    )
    with urllib.request.urlopen(req, timeout=120) as stream:
        stream.readline()  # the request is being served
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(erase, timeout=30)
        assert refused.value.code == 409
        assert json.loads(refused.value.read())["error"]["code"] == "profile_busy"
        stream.read()
    try:
        with urllib.request.urlopen(erase, timeout=30) as done:
            assert json.loads(done.read())["erased"] == "oneshot"
    except urllib.error.HTTPError as exc:  # say what the server answered (seen once as a 502 under load)
        raise AssertionError(f"erase after the stream: {exc.code} {exc.read()!r}\n{one.log()[-3000:]}") from exc
