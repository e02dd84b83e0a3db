"""What a server's chat template writes ahead of a prompt that has no system message of its own.

Qwen's templates write their default system prompt there ("You are Qwen, created by Alibaba Cloud. You are a helpful
assistant."): a one-line question with no system message prefilled 38 tokens on llama-server where the estimate,
which counts the request's own texts, said 22. The server says it exactly: its `/apply-template` renders one user
message alone and again after an empty system message, and `/tokenize` counts both. The difference, with the markers
of the block the empty message still gets, is the default block's tokens; a template that writes none (Gemma's folds a
system message into the first user turn) renders the bare prompt no longer than the other, and writes 0.

Asked once at start, in a few milliseconds (neither call takes a slot); any failure leaves 0: the estimate as before.
"""

from __future__ import annotations

import logging

import aiohttp

log = logging.getLogger(__name__)
_TIMEOUT = aiohttp.ClientTimeout(total=10)
_QUESTION = "What does this function return?"


def opening_tokens(bare: int, after_empty_system: int, block_markers: float) -> float:
    """The template's tokens ahead of a bare prompt, from the two renderings' counts: the default block when the bare
    one is longer (the empty system message's block is `block_markers` long), else none."""
    extra = bare - after_empty_system
    return extra + block_markers if extra > 0 else 0.0


async def measure(client: aiohttp.ClientSession, base_url: str, block_markers: float) -> float:
    """The opening of the chat template the server at `base_url` serves (0 when it cannot say)."""
    try:
        bare = await _rendered_tokens(client, base_url, [{"role": "user", "content": _QUESTION}])
        empty = await _rendered_tokens(
            client, base_url, [{"role": "system", "content": ""}, {"role": "user", "content": _QUESTION}]
        )
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
        log.debug("template opening not measured at %s (%s): estimates count none", base_url, exc)
        return 0.0
    return opening_tokens(bare, empty, block_markers)


async def _rendered_tokens(client: aiohttp.ClientSession, base_url: str, messages: list[dict[str, str]]) -> int:
    async with client.post(f"{base_url}/apply-template", json={"messages": messages}, timeout=_TIMEOUT) as resp:
        resp.raise_for_status()
        prompt = (await resp.json(content_type=None))["prompt"]
    if not isinstance(prompt, str):
        raise ValueError("/apply-template answered no prompt")
    body = {"content": prompt, "add_special": True, "parse_special": True}
    async with client.post(f"{base_url}/tokenize", json=body, timeout=_TIMEOUT) as resp:
        resp.raise_for_status()
        tokens = (await resp.json(content_type=None))["tokens"]
    if not isinstance(tokens, list):
        raise ValueError("/tokenize answered no tokens")
    return len(tokens)
