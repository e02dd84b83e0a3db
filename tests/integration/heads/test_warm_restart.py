"""Warm starts across a real restart, on each attention family people run (real processes: `serve` and its
llama-server stopped and started): the dense Qwen2.5-Coder 0.5B, Gemma 3 270M (sliding-window attention) and the tiny
`qwen35` hybrid target (a recurrent layer, as in Qwen3.5/3.6). The heads folder is one that has lived: heads of other
models, builds and projects beside the one that matches, and a damaged copy of it, which must neither shadow nor block
the restore, start after start.

What must hold after each restart, for a new session with the stored head: its prompt reuses the head (`prompt_n` at
most 5% of the cold turn's), and its first 32 greedy tokens equal those of a cold run made with the same prefill split
(CPU results can change with batch splits): the slot erased, the prompt's first tokens prefilled on their own, up to
where the restore resumed (the end of the prompt but one on a dense target; a sliding-window or recurrent cache resumes
only at a context checkpoint, which b11549 makes a few tokens before a prompt's end), then the same request."""

from __future__ import annotations

import json
import os
import time
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.models.tiny_drafters import write_tiny_mtp_target
from tests.support.processes.servers import ProxyProcess, chat_record, http_json, wait_until

# About 1,000 tokens of an agent-like system prompt: long enough to be kept as a head, short enough to prefill in
# seconds on 2 cores.
SYSTEM = "You are a coding agent working in a repository. Rules:\n" + "\n".join(
    f"{i}. Keep function_{i} small, typed and tested; never edit file_{i}.py without reading it first."
    for i in range(36)
)
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write hello.py that prints hello."}]
GREEDY_TOKENS = 32
PROFILE = "oneshot"  # every request on one profile: greedy text differs between speculation settings
PINNED = {"x-adaptive-spec-profile": PROFILE}


@dataclass(frozen=True)
class Family:
    name: str
    args: tuple[str, ...]


@pytest.fixture(
    params=["dense-qwen2.5-0.5b", "swa-gemma3-270m", "hybrid-tiny-qwen35"],
)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    name: str = request.param
    if name.startswith("dense"):
        request.getfixturevalue("qwen_gguf")  # assembled (and marked `qwen`) before serve needs it
        return Family(name, ("--model", "embedded:qwen2.5-coder-0.5b"))
    if name.startswith("swa"):
        request.getfixturevalue("gemma_gguf")
        return Family(name, ("--model", "embedded:gemma3-270m"))
    request.getfixturevalue("llama_server_binary")
    target = write_tiny_mtp_target(tmp_path_factory.mktemp("hybrid") / "tiny-random-qwen35.gguf")
    return Family(name, ("--model", str(target)))


def _serve(family: Family, home: Path, *extra: str) -> ProxyProcess:
    env = {"ADAPTIVE_SPEC_STATE_DIR": str(home / "state"), "ADAPTIVE_SPEC_CONFIG_DIR": str(home / "config")}
    args = (*family.args, "--threads", "1", "--ctx-size", "8192", "--parallel", "1", "--tokenizer", "off", *extra)
    return ProxyProcess(*args, env=env)


def _heads(proxy: ProxyProcess, count: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 120
    while len(heads := http_json(proxy.base + "/adaptive/heads")["heads"]) < count:
        assert time.monotonic() < deadline, proxy.log()
        time.sleep(0.1)
    return list(heads)


def _live_a_while(heads_dir: Path, real_id: str) -> None:
    """Make the store one that has lived: beside the real head, heads of other models, builds and projects (each a
    file of its own, under keys no server here has, more recently used than the real one), and a damaged copy of
    the real head, under its key and chain and the most recently used of all, whose checksum no longer holds."""
    index_path = heads_dir / "index.json"
    index = json.loads(index_path.read_text())
    (real,) = [e for e in index if e["id"] == real_id]
    data = (heads_dir / f"{real_id}.head").read_bytes()
    newer = real["last_used_unix"] + 10
    for i in range(12):
        other = {
            **real,
            "id": f"{i:02d}" + "0" * 22,
            "key": f"{i:02d}" + "f" * 30,
            "links": [f"{i:02d}{n:030d}" for n in range(len(real["links"]))],
            "project": f"project-{i}",
            "agent": ["opencode", "claude-code", "qwen-code"][i % 3],
            "last_used_unix": newer + i,
            "session": "" if i % 2 else f"s{i:06d}",  # session states of other runs, ids as a run numbers them
        }
        content = data[: len(data) // 2] + bytes([i]) * (len(data) // 2)
        (heads_dir / f"{other['id']}.head").write_bytes(content)
        other["bytes"], other["crc"] = len(content), f"{zlib.crc32(content):08x}"
        index.append(other)
    damaged_id = "d" * 24
    broken = bytearray(data)
    broken[len(broken) // 2] ^= 0xFF
    (heads_dir / f"{damaged_id}.head").write_bytes(bytes(broken))
    os.chmod(heads_dir / f"{damaged_id}.head", 0o600)
    index.append({**real, "id": damaged_id, "last_used_unix": newer + 100})
    index_path.write_text(json.dumps(index))


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def _cold_with_split(proxy: ProxyProcess, tokens: int, resumed: int) -> dict[str, Any]:
    """On a `serve --no-heads` that has served nothing: the prompt's first `tokens - resumed` tokens prefilled on
    their own, straight on its llama-server (the split a restore that resumed there makes), then the first turn."""
    (server,) = {p["base_url"] for p in http_json(proxy.base + "/adaptive/profiles")["profiles"]}
    prompt = _post(f"{server}/apply-template", {"messages": MESSAGES})["prompt"]
    ids = _post(f"{server}/tokenize", {"content": prompt, "add_special": True, "parse_special": True})["tokens"]
    if len(ids) != tokens:  # the template wrote the BOS itself
        ids = _post(f"{server}/tokenize", {"content": prompt, "add_special": False, "parse_special": True})["tokens"]
    assert len(ids) == tokens, (len(ids), tokens)
    _post(f"{server}/completion", {"prompt": ids[: tokens - resumed], "n_predict": 0, "id_slot": 0})
    return chat_record(proxy, MESSAGES, GREEDY_TOKENS, **{"x-session-id": "split", **PINNED})


def _warm_line(proxy: ProxyProcess) -> str:
    found: list[str] = []

    def said() -> bool:
        found[:] = [line for line in proxy.stderr_lines if "slots at start" in line]
        return bool(found)

    wait_until(said, 120, "the warm start at start")
    return found[0]


def test_a_restarted_serve_restores_the_head_on_every_family(family: Family, tmp_path: Path) -> None:
    proxy = _serve(family, tmp_path)
    try:
        cold = chat_record(proxy, MESSAGES, GREEDY_TOKENS, **{"x-session-id": "cold", **PINNED})
        assert cold["status"] == 200 and cold["timings"]["cache_n"] < 16, cold["timings"]
        (head,) = _heads(proxy, 1)
    finally:
        proxy.stop()
    cold_n = cold["timings"]["prompt_n"]
    heads_dir = tmp_path / "state" / "heads"
    _live_a_while(heads_dir, str(head["id"]))
    warm_runs = []
    for restart in range(2):
        proxy = _serve(family, tmp_path)
        try:
            line = _warm_line(proxy)
            assert "1 of 1 heads restored" in line, proxy.log()
            warm = chat_record(proxy, MESSAGES, GREEDY_TOKENS, **{"x-session-id": f"restart-{restart}", **PINNED})
            listed = {h["id"] for h in http_json(proxy.base + "/adaptive/heads")["heads"]}
        finally:
            proxy.stop()
        assert warm["status"] == 200, warm
        assert "warm: head of" in warm["reason"], (warm["reason"], proxy.log())
        assert warm["timings"]["prompt_n"] <= max(5, cold_n // 20), (warm["timings"], cold_n)
        warm_runs.append(warm)
        assert "d" * 24 not in listed and head["id"] in listed, listed  # the damaged copy was refused, removed
        assert len(listed) == 13, listed  # the other heads stay
    timings = warm_runs[0]["timings"]
    assert warm_runs[1]["timings"]["prompt_n"] == timings["prompt_n"], [w["timings"] for w in warm_runs]
    proxy = _serve(family, tmp_path / "reference", "--no-heads")
    try:
        split = _cold_with_split(proxy, timings["prompt_n"] + timings["cache_n"], timings["prompt_n"])
    finally:
        proxy.stop()
    assert split["timings"]["prompt_n"] == timings["prompt_n"], (split["timings"], timings)
    for warm in warm_runs:
        assert warm["text"] == split["text"], (warm["text"], split["text"])
