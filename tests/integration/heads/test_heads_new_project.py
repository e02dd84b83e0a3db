"""A new project of a known agent restores the head of another project (real processes: `serve` and its llama-server,
stopped and started in between). The agent writes its working directory into its system prompt, as opencode does, so
the two prompts part inside their first piece; llama-server reuses the common token prefix of a restored slot on a
dense target, and a sliding-window or recurrent cache resumes only at a checkpoint, which a head keeps at its own
prompt's end.

The first project's head is saved, then a head of another agent (more recent: the one a restart puts back into the
idle slot), then `serve` restarts (llama-server's own RAM cache of prompts is gone) and the second project's first turn
comes. On the dense 0.5B it restores the first project's head: it reuses the prompt's common prefix with it, as many
tokens as the two share less a few, and its first 32 greedy tokens equal a cold run made with the same prefill split
(the slot erased, those tokens prefilled on their own, then the same request). On the sliding-window Gemma 3 270M and
the tiny hybrid target the store does not restore that head for it (the restore would buy nothing there)."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support.models.tiny_drafters import write_tiny_mtp_target
from tests.support.processes.servers import ProxyProcess, chat_record, http_json, wait_until

RULES = "You are a coding agent. Rules:\n" + "\n".join(
    f"{i}. Keep function_{i} small, typed and tested; never edit file_{i}.py without reading it first."
    for i in range(40)
)
TAIL = "\n".join(f"Tool {i} reads a path and a pattern and returns what it found there." for i in range(12))
OTHER_AGENT = "You are another assistant, with other habits.\n" + "\n".join(
    f"Habit {i}: answer in {i + 2} lines about module_{i}." for i in range(24)
)
GREEDY_TOKENS = 32
PINNED = {"x-adaptive-spec-profile": "oneshot"}  # greedy text differs between speculation settings
MARGIN_TOKENS = 8  # a block boundary inside a token, the one token llama-server always evaluates again


def _messages(system: str, directory: str | None) -> list[dict[str, str]]:
    if directory is not None:
        system = f"{system}\nWorking directory: {directory}\nIs a git repository: yes\n{TAIL}"
    return [{"role": "system", "content": system}, {"role": "user", "content": "Write hello.py that prints hello."}]


ALPHA = _messages(RULES, "/home/user/project-alpha")
BETA = _messages(RULES, "/home/user/project-beta")
OTHER = _messages(OTHER_AGENT, None)


@pytest.fixture(params=["dense-qwen2.5-0.5b", "swa-gemma3-270m", "hybrid-tiny-qwen35"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    name: str = request.param
    if name.startswith("dense"):
        request.getfixturevalue("qwen_gguf")
        return name, "embedded:qwen2.5-coder-0.5b"
    if name.startswith("swa"):
        request.getfixturevalue("gemma_gguf")
        return name, "embedded:gemma3-270m"
    request.getfixturevalue("llama_server_binary")
    return name, str(write_tiny_mtp_target(tmp_path_factory.mktemp("hybrid") / "tiny-random-qwen35.gguf"))


def _serve(model: str, home: Path, *extra: str) -> ProxyProcess:
    env = {"ADAPTIVE_SPEC_STATE_DIR": str(home / "state"), "ADAPTIVE_SPEC_CONFIG_DIR": str(home / "config")}
    args = ("--model", model, "--threads", "1", "--ctx-size", "8192", "--parallel", "1", "--tokenizer", "off", *extra)
    return ProxyProcess(*args, env=env)


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def _server(proxy: ProxyProcess) -> str:
    (server,) = {p["base_url"] for p in http_json(proxy.base + "/adaptive/profiles")["profiles"]}
    return str(server)


def _tokens(server: str, messages: list[dict[str, str]]) -> list[int]:
    prompt = _post(f"{server}/apply-template", {"messages": messages})["prompt"]
    return list(_post(f"{server}/tokenize", {"content": prompt, "add_special": True, "parse_special": True})["tokens"])


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _heads(proxy: ProxyProcess, count: int) -> None:
    deadline = time.monotonic() + 120
    while len(http_json(proxy.base + "/adaptive/heads")["heads"]) < count:
        assert time.monotonic() < deadline, proxy.log()
        time.sleep(0.1)


def _warm_line(proxy: ProxyProcess) -> str:
    found: list[str] = []

    def said() -> bool:
        found[:] = [line for line in proxy.stderr_lines if "slots at start" in line]
        return bool(found)

    wait_until(said, 120, "the warm start at start")
    return found[0]


def test_a_new_project_reuses_the_prefix_it_shares_with_another_projects_head(
    model: tuple[str, str], tmp_path: Path
) -> None:
    family, path = model
    proxy = _serve(path, tmp_path)
    try:
        alpha = chat_record(proxy, ALPHA, GREEDY_TOKENS, **{"x-session-id": "alpha", **PINNED})
        _heads(proxy, 1)
        chat_record(proxy, OTHER, GREEDY_TOKENS, **{"x-session-id": "other", **PINNED})
        _heads(proxy, 2)
        server = _server(proxy)
        common = _common(_tokens(server, ALPHA), _tokens(server, BETA))
        beta_tokens = len(_tokens(server, BETA))
    finally:
        proxy.stop()
    assert alpha["status"] == 200 and alpha["timings"]["cache_n"] < 16, alpha["timings"]
    assert 0.5 * beta_tokens < common < beta_tokens - 100, (common, beta_tokens)  # they part inside the system prompt
    proxy = _serve(path, tmp_path)
    try:
        assert "1 of 1 heads restored" in _warm_line(proxy), proxy.log()  # the other agent's head, into the one slot
        beta = chat_record(proxy, BETA, GREEDY_TOKENS, **{"x-session-id": "beta", **PINNED})
        counts = http_json(proxy.base + "/adaptive/heads")["counts"]
    finally:
        proxy.stop()
    assert beta["status"] == 200, beta
    timings = beta["timings"]
    if not family.startswith("dense"):
        # A checkpointed cache would resume at none of that head's checkpoints (they sit at its prompt's end): the
        # store does not restore it, and the prompt prefills as it would have.
        assert "warm:" not in beta["reason"], (beta["reason"], proxy.log())
        assert counts["restored"] == 1, counts  # the warm start's alone
        assert timings["cache_n"] < 16, timings
        return
    assert "warm: head of" in beta["reason"] and "of them this prompt's" in beta["reason"], (
        beta["reason"],
        proxy.log(),
    )
    assert timings["cache_n"] >= common - MARGIN_TOKENS, (timings, common)
    assert timings["prompt_n"] < alpha["timings"]["prompt_n"] // 2, (timings, alpha["timings"])
    assert beta["new_tokens_est"] < alpha["new_tokens_est"] // 2, (beta["new_tokens_est"], alpha["new_tokens_est"])
    reference = _serve(path, tmp_path / "reference", "--no-heads")
    try:
        server = _server(reference)
        ids = _tokens(server, BETA)
        _post(f"{server}/completion", {"prompt": ids[: timings["cache_n"]], "n_predict": 0, "id_slot": 0})
        split = chat_record(reference, BETA, GREEDY_TOKENS, **{"x-session-id": "split", **PINNED})
    finally:
        reference.stop()
    assert split["timings"]["prompt_n"] == timings["prompt_n"], (split["timings"], timings)
    assert beta["text"] == split["text"], (beta["text"], split["text"])
