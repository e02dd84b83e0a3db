"""Model drafters on REAL launched profiles: `serve --draft-type dflash|eagle3|mtp` with tiny random-weight drafters
(tests/support/models/tiny_drafters.py). Both profiles start, /slots shows their speculation types, streamed requests
carry draft counts equal to llama-server's own counters, the router takes the drafter + n-gram profile for the n-gram
one, and a session moving between the pair follows the KV-handoff rule for draft-model profiles.

A random drafter accepts what it accepts: these tests assert that drafting happened and was counted, never a rate.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.models.tiny_drafters import write_tiny_dflash, write_tiny_eagle3, write_tiny_mtp_target
from tests.support.processes.servers import LlamaServer, ProxyProcess, http_json, wait_until
from tests.support.sse import stream_events

# Routing turns over quickly on the tiny model: hand over any context, move after one turn.
POLICY = """\
[route]
min_dwell_turns = 1

[handoff]
min_tokens = 0
with_draft_models = {with_draft_models}
# The tiny models' slot files: kilobytes, a millisecond to save or restore (tests/support/models/tiny_policy.py).
save_s_per_1k = 0.001
restore_s = 0.001
"""
PASTED = "```python\n" + "\n".join(f"value_{i} = {i} * {i}" for i in range(40)) + "\n```\n"
Messages = list[dict[str, str]]
SPEC = {"dflash": "draft-dflash", "eagle3": "draft-eagle3", "mtp": "draft-mtp"}


class Launched:
    """`serve` with one drafter type, its home directory and policy file."""

    def __init__(self, kind: str, proxy: ProxyProcess, home: Path) -> None:
        self.kind, self.proxy, self.home = kind, proxy, home
        self.policy = home / "policy.toml"

    def set_policy(self, *, with_draft_models: bool) -> None:
        self.policy.write_text(POLICY.format(with_draft_models=str(with_draft_models).lower()))


@pytest.fixture(scope="module", params=list(SPEC))
def launched(
    request: pytest.FixtureRequest, tiny_gguf: Path, llama_server_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Launched]:
    kind = str(request.param)
    home = tmp_path_factory.mktemp(kind)
    if kind == "mtp":  # MTP drafts with the target's own heads: a target of its own, no --draft
        model = ["--model", str(write_tiny_mtp_target(home / "tiny-random-qwen35-mtp.gguf"))]
    else:
        writer = write_tiny_dflash if kind == "dflash" else write_tiny_eagle3
        model = ["--model", str(tiny_gguf), "--draft", str(writer(home / f"tiny-random-{kind}.gguf"))]
    (home / "policy.toml").write_text(POLICY.format(with_draft_models="false"))
    proxy = ProxyProcess(
        *model,
        "--server-per-profile",  # each profile its own server, moves between them (one server: test_one_server.py)
        "--no-heads",  # a re-prefill is compared with a restore here: no stored head may warm the re-prefill
        "--draft-type",
        kind,
        "--threads",
        "1",
        "--ctx-size",
        "8192",
        "--policy",
        str(home / "policy.toml"),
        env={"ADAPTIVE_SPEC_STATE_DIR": str(home / "state"), "ADAPTIVE_SPEC_CONFIG_DIR": str(home / "config")},
    )

    def measured() -> bool:  # each server's speeds measured at start: its drafts are not a test's to count
        return bool(sum(r.get("own") == "speed measurement" for r in proxy.requests()) == 2)

    wait_until(measured, 120, "the speed measurements at start")
    yield Launched(kind, proxy, home)
    proxy.stop()


def stream_record(proxy: ProxyProcess, messages: Messages, max_tokens: int, **headers: str) -> dict[str, Any]:
    """One greedy streamed chat request through the proxy: its record, with the text and the final chunk's timings."""
    body = {"model": "m", "messages": messages, "temperature": 0, "seed": 1, "max_tokens": max_tokens, "stream": True}
    req = urllib.request.Request(
        proxy.base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    text, timings = [], None
    with urllib.request.urlopen(req, timeout=300) as resp:
        request_id = resp.headers["x-adaptive-spec-request-id"]
        for event in stream_events(resp):
            if event.data.startswith("{"):
                chunk = json.loads(event.data)
                timings = chunk.get("timings", timings)
                text += [c["delta"].get("content") or "" for c in chunk.get("choices") or []]
    record = next(r for r in proxy.requests() if r["request_id"] == request_id)
    return {**record, "text": "".join(text), "stream_timings": timings}


def _upstream(proxy: ProxyProcess, profile: str, path: str) -> bytes:
    req = urllib.request.Request(proxy.base + path, headers={"x-adaptive-spec-profile": profile})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return bytes(resp.read())


def spec_counters(proxy: ProxyProcess, profile: str) -> tuple[int, int]:
    """llama-server's own drafted and accepted totals for one profile (its /metrics, through the proxy)."""
    values = dict(
        line.rsplit(" ", 1)
        for line in _upstream(proxy, profile, "/metrics").decode().splitlines()
        if line and not line.startswith("#")
    )
    return (
        int(float(values["llamacpp:spec_decode_num_draft_tokens_total"])),
        int(float(values["llamacpp:spec_decode_num_accepted_tokens_total"])),
    )


def test_both_profiles_start_draft_and_count_like_llama_server(launched: Launched) -> None:
    proxy, drafter = launched.proxy, SPEC[launched.kind]
    # llama-server lists its types after a leading "none" (the type of a request that drafts nothing)
    expected = {"oneshot": f"none,{drafter}", "iterative": f"none,{drafter},ngram-mod"}
    for profile, types in expected.items():
        before = spec_counters(proxy, profile)
        question = [{"role": "user", "content": f"Write a long story about {profile} drafting."}]
        record = stream_record(proxy, question, 96, **{"x-adaptive-spec-profile": profile})
        drafted, accepted = (a - b for a, b in zip(spec_counters(proxy, profile), before, strict=True))
        timings = record["timings"]
        assert (record["status"], record["profile"]) == (200, profile)
        assert timings["predicted_n"] > 0 and record["text"]
        assert drafted > 0, f"{profile} did not draft: {timings}"
        assert (timings["draft_n"], timings["draft_n_accepted"]) == (drafted, accepted), (timings, drafted, accepted)
        assert record["stream_timings"]["draft_n"] == drafted  # the record is the stream's own final figure
        slots = json.loads(_upstream(proxy, profile, "/slots"))
        assert slots[0]["params"]["speculative.types"] == types, slots[0]["params"]
    listed = {p["name"]: p["spec_types"] for p in http_json(proxy.base + "/adaptive/profiles")["profiles"]}
    assert listed == {name: types.split(",")[1:] for name, types in expected.items()}, listed  # the proxy drops it


def test_the_drafter_and_ngram_profile_is_the_ngram_one(launched: Launched) -> None:
    proxy = launched.proxy
    speeds = {s["profile"]: s["ngram"] for s in http_json(proxy.base + "/adaptive/route")["speeds"]}
    assert speeds == {"oneshot": False, "iterative": True}
    one = stream_record(proxy, [{"role": "user", "content": "What is 12 + 30?"}], 8)
    assert (one["profile"], one["route"]) == ("oneshot", "estimate"), one["reason"]
    edit = stream_record(proxy, [{"role": "user", "content": PASTED + "Return the complete file."}], 8)
    assert (edit["profile"], edit["route"]) == ("iterative", "estimate"), edit["reason"]
    assert "prompt asks for a pasted file back" in edit["reason"]


def _move(launched: Launched, session: str) -> tuple[dict[str, Any], dict[str, Any], Messages]:
    """A session's first turn pinned to `oneshot`, its second pinned to `iterative`: both records, and the second
    turn's messages."""
    proxy = launched.proxy
    # The session's name leads the prompt: no other test's prompt shares a cached prefix with it.
    history = [{"role": "user", "content": f"Session {session}.\n" + PASTED + "What does this module do?"}]
    first = stream_record(proxy, history, 32, **{"x-session-id": session, "x-adaptive-spec-profile": "oneshot"})
    history += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "And in one word?"}]
    second = stream_record(proxy, history, 64, **{"x-session-id": session, "x-adaptive-spec-profile": "iterative"})
    assert (second["status"], second["route"], second["moved_from"]) == (200, "pinned", "oneshot"), second
    return first, second, history


def test_a_move_between_drafter_profiles_follows_the_handoff_rule(launched: Launched) -> None:
    # By default the KV cache is handed over only between profiles without a separate draft model: DFlash and
    # EAGLE3 sessions re-prefill; MTP drafts with the target's own heads, so its sessions take their cache along.
    first, moved, _ = _move(launched, "default-rule")
    context = first["timings"]["prompt_n"] + first["timings"]["cache_n"]
    if launched.kind == "mtp":
        assert moved["handoff"] and moved["handoff"]["ok"] and moved["handoff"]["tokens"] > context, moved["handoff"]
        # The tiny MTP target is hybrid (a recurrent layer, as in Qwen3.5/3.6): a recurrent state cannot be rolled
        # back, so the new prompt resumes at a context checkpoint, which llama.cpp b11549 keeps in the slot file (it
        # makes one a few tokens before each prompt's end): all of the first turn's prompt but those is reused.
        assert context - 8 <= moved["timings"]["cache_n"] <= context, (moved["timings"], context)
        assert moved["handoff"]["reused"] == moved["timings"]["cache_n"], moved["handoff"]
        # The router learns that it paid: the next move between the pair hands the cache over again.
        _, again, _ = _move(launched, "after-a-handoff-that-paid")
        assert again["handoff"] and again["handoff"]["ok"], again["handoff"]
        assert again["timings"]["cache_n"] > 0, again["timings"]
    else:
        assert moved["handoff"] is None
        assert moved["timings"]["cache_n"] < context // 2, moved["timings"]  # re-prefilled
    assert moved["timings"]["draft_n"] > 0  # the drafter drafts after the move either way


def test_with_draft_models_the_cache_moves_and_the_drafter_starts_empty(launched: Launched) -> None:
    if launched.kind == "mtp":
        pytest.skip("MTP has no separate draft model: the default rule already hands its cache over")
    proxy = launched.proxy
    launched.set_policy(with_draft_models=True)
    route = proxy.base + "/adaptive/route"
    wait_until(lambda: http_json(route)["policy"]["policy"]["handoff"]["with_draft_models"], 15, "the policy reload")
    try:
        first, moved, history = _move(launched, "with-draft-models")
    finally:
        launched.set_policy(with_draft_models=False)
    context = first["timings"]["prompt_n"] + first["timings"]["cache_n"]
    assert moved["handoff"] and moved["handoff"]["ok"], moved["handoff"]
    # The slot file holds the target's cache only: the target reuses it, and the drafter, its own cache empty,
    # still drafts and the request succeeds.
    assert moved["timings"]["cache_n"] >= context - 4, moved["timings"]
    assert moved["timings"]["draft_n"] > 0
    # Greedy text after the restore equals the text after a re-prefill of the same prompt on the same profile.
    _erase(proxy, "iterative")
    again = stream_record(proxy, history, 64, **{"x-session-id": "again", "x-adaptive-spec-profile": "iterative"})
    assert again["timings"]["cache_n"] < context // 2, again["timings"]
    assert again["text"] == moved["text"], (again["text"], moved["text"])


def _erase(proxy: ProxyProcess, profile: str) -> None:
    """Through the proxy's own endpoint: clients may not send llama-server slot actions (the router owns slots)."""
    headers = {"Content-Type": "application/json"}
    url = f"{proxy.base}/adaptive/profiles/{profile}/erase"
    req = urllib.request.Request(url, data=b"{}", method="POST", headers=headers)
    with urllib.request.urlopen(req, timeout=60) as resp:
        resp.read()


def test_bench_compares_plain_dflash_and_dflash_ngram_on_real_processes(
    tiny_gguf: Path, llama_server_binary: str, tmp_path: Path
) -> None:
    # The seed's table, plain / DFlash / DFlash + n-gram / adaptive, out of three real llama-servers of the tiny
    # pair behind one proxy.
    dflash = str(write_tiny_dflash(tmp_path / "tiny-random-dflash.gguf"))
    common = ["-c", "8192", "--parallel", "1", "--metrics", "-fa", "on"]
    setups = {
        "plain": ["--spec-type", "none"],
        "dflash": ["-md", dflash, "--spec-type", "draft-dflash"],
        "dflash-ngram": ["-md", dflash, "--spec-type", "draft-dflash,ngram-mod"],
    }
    servers: dict[str, LlamaServer] = {}
    try:
        for name, args in setups.items():
            servers[name] = LlamaServer(llama_server_binary, tiny_gguf, *common, *args, log_dir=tmp_path / "logs")
        attach = [a for name, s in servers.items() for a in ("--profile", f"{name}={s.url}")]
        proxy = ProxyProcess(*attach, env={"ADAPTIVE_SPEC_STATE_DIR": str(tmp_path / "state")})
        try:
            out = tmp_path / "bench"
            argv = [
                sys.executable,
                "-m",
                "adaptive_spec",
                "bench",
                "--url",
                proxy.base,
                "--workload",
                "iterative",
                "--profiles",
                ",".join(setups),
                "--adaptive",
                "--max-tokens",
                "16",
                "--repeat",
                "1",
                "--out",
                str(out),
            ]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        finally:
            proxy.stop()
    finally:
        for server in servers.values():
            server.stop()
    assert done.returncode == 0, done.stderr
    assert "random weights, so these figures measure plumbing, not speed" in done.stdout
    result = json.loads((out / "bench.json").read_text())
    assert result["baseline"] == "plain"
    references = {"best static per request", "best seen per request"}
    assert {r["name"] for r in result["rows"]} == {*setups, "adaptive", *references}
    records = result["records"]["iterative"]
    assert all(r["outcome"] == "finished" for r in records)
    drafted = {name: sum(r["timings"].get("draft_n", 0) for r in records if r["profile"] == name) for name in setups}
    assert drafted["plain"] == 0 and drafted["dflash"] > 0 and drafted["dflash-ngram"] > 0, drafted
    (tmp_path.parent / "bench-stdout.txt").write_text(done.stdout)
