"""Which tokens `serve`'s session statistics count with: the GGUF's own vocabulary (the launched model's, or an
attached server's file when it is on this machine and tokenizes as the server does), the profile's /tokenize, or
tiktoken's o200k as the last resort."""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp

from adaptive_spec.errors import ConfigError, LaunchError
from adaptive_spec.sessions.tokenizers import (
    CachingTokenizer,
    EndpointTokenizer,
    GgufTokenizer,
    Tokenizer,
    llama_vocab_tokenizer,
    tiktoken_o200k,
)


async def choose_tokenizer(
    choice: str,
    model_path: str | None,
    session: aiohttp.ClientSession,
    default_url: str,
    attached_model: str = "",
    *,
    verbose: bool = False,
    say: Callable[[str], None],
) -> Tokenizer | None:
    """The token source for session statistics (`serve --tokenizer`): the GGUF's own, the profile's /tokenize, or
    tiktoken. `model_path`: the launched model's file; `attached_model`: the file an attached default profile's
    /props names."""
    if choice == "off":
        return None
    if model_path is None and choice in ("auto", "gguf"):
        attached = await attached_tokenizer(session, default_url, attached_model, verbose, say)
        if attached is not None:
            return attached
    if choice in ("auto", "gguf") and model_path:
        found = await asyncio.to_thread(llama_vocab_tokenizer, model_path, verbose)
        if found is not None:
            return CachingTokenizer(found)
        if choice == "gguf":
            raise ConfigError("--tokenizer gguf needs llama-cpp-python: pip install 'adaptive-spec[gguf-tokenizer]'")
    if choice in ("auto", "endpoint"):
        endpoint = EndpointTokenizer(session, default_url)
        try:
            await endpoint.encode(["probe"])
            return CachingTokenizer(endpoint)
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
            if choice == "endpoint":
                raise LaunchError(f"--tokenizer endpoint: {default_url}/tokenize failed: {exc}") from exc
            say(f"{default_url}/tokenize failed ({exc}); counting tokens with tiktoken o200k_base instead")
    return CachingTokenizer(await asyncio.to_thread(tiktoken_o200k))


async def attached_tokenizer(
    session: aiohttp.ClientSession,
    base_url: str,
    model_path: str,
    verbose: bool = False,
    say: Callable[[str], None] = lambda message: print(message, file=sys.stderr, flush=True),
) -> Tokenizer | None:
    """The GGUF an attached llama-server on this machine names, read here, when it tokenizes a probe text exactly
    as the server's own /tokenize does (a loopback port may lead to a container or a tunnel whose path means another
    file here, and a newer server may read its file differently): else None, and the caller asks the server."""
    if not await asyncio.to_thread(local_model, base_url, model_path):
        return None
    try:
        local = await asyncio.to_thread(llama_vocab_tokenizer, model_path, verbose)
        if not isinstance(local, GgufTokenizer):
            return None
        mine = [await asyncio.to_thread(local.llama_encode, _VOCAB_PROBE)]  # llama.cpp's own, as the server's
        theirs = await EndpointTokenizer(session, base_url).encode([_VOCAB_PROBE])
    except Exception as exc:  # a file llama-cpp-python cannot read, a server that does not answer: ask the server
        say(f"sessions: not reading {model_path} here ({exc}); asking the profile's /tokenize")
        return None
    if mine != theirs:
        say(f"sessions: {model_path} here does not tokenize as the profile does; asking the profile's /tokenize")
        return None
    return CachingTokenizer(local)


# Code, prose, digits and another script: what two vocabularies that differ would split differently.
_VOCAB_PROBE = "def main(argv):\n    return 42  # It's done: 3.14 ms, \u00e9t\u00e9, \u4e2d\u6587, \U0001f600\n"


def local_model(base_url: str, model_path: str) -> bool:
    """An attached profile's model file may be this machine's: the server listens on a loopback address and the file
    (absolute, a regular file, a GGUF by its magic) is here."""
    host = urlsplit(base_url).hostname or ""
    if host not in ("localhost", "127.0.0.1", "::1") or not model_path or not os.path.isabs(model_path):
        return False
    try:
        if not stat.S_ISREG(os.stat(model_path).st_mode):  # not a pipe or a device, whose read would wait
            return False
        with open(model_path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except (OSError, ValueError):  # ValueError: a NUL or a lone surrogate in the path
        return False
