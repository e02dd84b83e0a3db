"""The statistics tokenizer of an attached llama-server on this machine: its GGUF is read here only when it splits a
probe text as the server's own /tokenize does. The server here is a fake whose /tokenize either is the GGUF's own
(llama-cpp-python over the same file) or is not: a container or tunnel on a loopback port whose path names another
file here is what a real server cannot be made to show on demand."""

from __future__ import annotations

import os
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from adaptive_spec.sessions import token_source as session_tokens
from adaptive_spec.sessions.tokenizers import GgufTokenizer, llama_vocab_tokenizer
from tests.support.fakes.fake_upstream import FakeUpstream
from tests.support.models.tiny_gguf import write_tiny_gguf


@pytest.mark.asyncio(loop_scope="function")
async def test_the_local_gguf_is_read_only_when_it_tokenizes_as_the_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("llama_cpp")
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    reference = llama_vocab_tokenizer(str(gguf))
    assert isinstance(reference, GgufTokenizer)
    same = {"value": True}

    async def tokenize(request: web.Request) -> web.Response:
        text = (await request.json())["content"]
        tokens = reference.llama_encode(text)
        return web.json_response({"tokens": tokens if same["value"] else [t + 1 for t in tokens]})

    server = FakeUpstream(routes={("POST", "/tokenize"): tokenize})
    url = await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            found = await session_tokens.attached_tokenizer(session, url, str(gguf))
            assert found is not None and found.name == "gguf:tiny.gguf"
            same["value"] = False  # another file behind that path
            assert await session_tokens.attached_tokenizer(session, url, str(gguf)) is None
            assert "does not tokenize as the profile does" in capsys.readouterr().err
            # not this machine's address: never read here
            assert await session_tokens.attached_tokenizer(session, "http://10.1.2.3:9", str(gguf)) is None
    finally:
        await server.close()


def test_an_attached_servers_path_that_is_not_a_regular_gguf_is_not_opened(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)  # reading it would wait for a writer forever
    assert not session_tokens.local_model("http://127.0.0.1:1", str(fifo))
    assert not session_tokens.local_model("http://127.0.0.1:1", "/tmp/a\x00b.gguf")
    assert not session_tokens.local_model("http://127.0.0.1:1", "/tmp/\ud800.gguf")
    assert not session_tokens.local_model("http://127.0.0.1:1", str(tmp_path))  # a directory
