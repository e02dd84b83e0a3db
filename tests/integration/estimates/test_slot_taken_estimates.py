"""A main conversation interleaved with a classifier-like short request (another system prompt, a new session each time,
as Gemini CLI's model router sends it) on a REAL one-slot llama-server (the tiny model: the plumbing; llama-server's
RAM prompt cache on, as `serve` leaves it), each estimate within 15% of llama-server's `prompt_n`: the main line's
next turn, whether the classifier took the slot by a request (the main prompt saved to the RAM cache and restored) or
by a head restored for it (nothing of the main prompt left); the same prompt sent again (the one token llama-server
evaluates of it); and, without heads, the classifier finding its earlier prompt in the RAM cache."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from tests.support.heads import chat, start_proxy, store_of
from tests.support.processes.servers import LlamaServer, ProxyProcess, chat_record

MAIN = "You are a synthetic coding agent. Read before you edit, keep answers short, and say what you changed.\n" * 30
CLASSIFIER = "Score how hard the request is, from 1 to 100, and say why, in JSON, weighing the files it names.\n" * 30
ESTIMATE_ERROR = 0.15


@pytest_asyncio.fixture(loop_scope="function")
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def _off(record: dict[str, Any]) -> bool:
    prompt_n: int = record["timings"]["prompt_n"]
    estimate: int = record["new_tokens_est"]
    return abs(estimate - prompt_n) > max(ESTIMATE_ERROR * prompt_n, 8)


@pytest.mark.asyncio(loop_scope="function")
async def test_the_main_lines_turns_are_estimated_as_what_the_slot_and_ram_cache_hold(
    llama_server_binary: str, tiny_gguf: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    args = ("-c", "8192", "-t", "1", "--parallel", "1", "--spec-type", "none", "--slot-save-path")
    llama = LlamaServer(llama_server_binary, tiny_gguf, *args, str(tmp_path), log_dir=tmp_path)
    proxy = await start_proxy(llama.url, tmp_path, tmp_path / "heads")
    history: list[dict[str, str]] = []
    turns = []
    try:
        for turn, text in enumerate(("Create hello.py.", "Make it print bye.", "Add a main guard.")):
            classifier = await chat(client, proxy, f"classifier-{turn}", text, system=CLASSIFIER)
            await store_of(proxy).settled()  # its head saved (the first), or restored (the next ones)
            main = await chat(client, proxy, "main", text, system=MAIN, history=history)
            await store_of(proxy).settled()
            history += [{"role": "user", "content": text}, {"role": "assistant", "content": main["text"]}]
            turns.append((classifier["record"], main["record"]))
        again = await chat(client, proxy, "main", text, system=MAIN, history=history[:-2])  # held whole
    finally:
        await proxy.close()
        llama.stop()
    seen = [
        (c["reason"].split("; ")[-1], m["new_tokens_est"], m["timings"]["prompt_n"], m["timings"]["cache_n"])
        for c, m in turns
    ]
    assert any("warm: head of" in c["reason"] for c, _ in turns[1:]), seen  # a head restored into the slot
    assert not any(_off(m) for _, m in turns[1:]), seen
    repeat = again["record"]
    assert repeat["timings"]["prompt_n"] == 1 and repeat["new_tokens_est"] == 1, repeat


def test_a_classifier_sent_as_a_new_session_is_estimated_as_what_the_ram_cache_leaves(tiny_server: LlamaServer) -> None:
    """No heads: the classifier's earlier prompt, displaced from the slot by the main line's turn, is in llama-server's
    RAM cache, and the next classifier (a new session) prefills only what follows the part they share."""
    proxy = ProxyProcess("--profile", f"plain={tiny_server.url}", "--no-heads")
    history: list[dict[str, str]] = []
    classifiers = []
    try:
        for turn, text in enumerate(("Create hello.py.", "Make it print bye.", "Add a main guard.")):
            asked = [{"role": "system", "content": CLASSIFIER}, {"role": "user", "content": text}]
            classifiers.append(chat_record(proxy, asked, 4, **{"x-session-id": f"classifier-{turn}"}))
            main = [{"role": "system", "content": MAIN}, *history, {"role": "user", "content": text}]
            answer = chat_record(proxy, main, 4, **{"x-session-id": "main"})
            history += [{"role": "user", "content": text}, {"role": "assistant", "content": answer["text"]}]
    finally:
        proxy.stop()
    seen = [(r["new_tokens_est"], r["timings"]["prompt_n"], r["timings"]["cache_n"]) for r in classifiers]
    assert all(r["timings"]["cache_n"] > 1000 for r in classifiers[1:]), seen  # from the RAM cache
    assert not any(_off(r) for r in classifiers[1:]), seen
