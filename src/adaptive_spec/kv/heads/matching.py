"""Pure: what a stored head is (`HeadEntry`), what makes its KV reusable on a server (`ServerKey`), the chain of digests
a prompt's leading pieces make under that key (and of each piece's 256-character blocks after them), the longest stored
match of a new prompt, a head's bytes before it is saved (`head_size`), the LRU eviction and whether a restore pays
against a prefill.

No file, no HTTP: the store (`kv/heads/store.py`) does those."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from adaptive_spec.kv.costs import PrefillRate

DEFAULT_MAX_BYTES = 2 * 1024**3  # 2 GiB: ~23 opencode heads of the 0.5B (~88 MB each)
MIN_HEAD_TOKENS = 256  # a shorter first turn prefills in well under a second on the slowest machine here
MIN_GAIN_TOKENS = 64  # a restore must bring at least this many tokens more than the slot holds
RESTORE_OVERHEAD_S = 0.05  # two slot actions and a link or copy, beyond reading the file
RESTORE_PRIOR_BYTES_PER_S = 400e6  # until a restore is measured: a page-cached file read by llama-server
LAST_PIECE_SHARE = 0.05  # a first message this small a share of its prompt does not make a head of its own
INERT_SHARE = 0.5  # a restore whose next prompt reused less than this share of the expected tokens did nothing
# A piece's text is also kept as digests of its blocks of this many characters: a prompt that parts from a head inside
# a piece (opencode's working directory in its system prompt) is known to share the blocks before that point.
BLOCK_CHARS = 256
_BLOCK_DIGEST = 8


@dataclass(frozen=True, slots=True)
class ServerKey:
    """What a slot file's KV depends on: the model file (path, size and `model_sample`: `sha256:` and the digest of its
    whole content, read once per file and kept by the file's identity), the slot's context, the chat
    template (a digest of it), the build that wrote it (the binary's identity where `serve` launched it, and the
    server's own build_info) and the K and V cache types (`-ctk`, `-ctv` of launched servers; "" for attached ones,
    whose /props does not say). Two servers with equal keys can restore each other's heads."""

    model: str
    model_bytes: int
    n_ctx: int
    template_digest: str
    model_sample: str = ""
    build: str = ""
    cache_type_k: str = ""
    cache_type_v: str = ""

    def digest(self) -> bytes:
        parts = (self.model, self.model_bytes, self.n_ctx, self.template_digest, self.model_sample, self.build)
        text = "\0".join(str(p) for p in (*parts, self.cache_type_k, self.cache_type_v))
        return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    def hex(self) -> str:
        return self.digest().hex()


def template_digest(template: str) -> str:
    return hashlib.blake2b(template.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()


NO_TENANT = "\0"  # with project keys: the scope of a request sent with no project's key (no project is named so)


def tenant_scope(sent_keys: Iterable[str], project_keys: Mapping[str, str]) -> str:
    """The scope a request's heads are kept and found in: "" (shared) without project keys; with them, the project
    of the project key the caller sent, whatever its path says, else `NO_TENANT` (the main key or none). Every key
    is compared, in constant time, against every project key."""
    if not project_keys:
        return ""
    found = NO_TENANT
    for sent in sent_keys:
        for key, project in project_keys.items():
            if hmac.compare_digest(sent.encode("utf-8", "surrogateescape"), key.encode("utf-8", "surrogateescape")):
                found = project
    return found


def _seed(key: ServerKey, scope: str) -> bytes:
    return key.digest() if not scope else hashlib.blake2b(key.digest() + scope.encode(), digest_size=16).digest()


def chain(key: ServerKey, piece_digests: Iterable[bytes], scope: str = "") -> tuple[str, ...]:
    """Link i covers the key and pieces 0..i: two prompts share their first n links exactly when they share the
    key and their first n pieces, so a match is found without the text. `scope` (a project, where projects are
    tenants: `serve --project-key`) keeps one scope's heads from matching another's prompts."""
    links: list[str] = []
    previous = _seed(key, scope)
    for digest in piece_digests:
        previous = hashlib.blake2b(previous + digest, digest_size=16).digest()
        links.append(previous.hex())
    return tuple(links)


def text_blocks(kind: str, text: str) -> tuple[bytes, ...]:
    """The digest of each whole `BLOCK_CHARS` block of a piece's text (and its kind: a role, "tools", "prompt"), the
    same in every process: what `block_chains` links to the pieces before it."""
    tag = kind.encode("utf-8", "surrogatepass") + b"\0"
    return tuple(
        hashlib.blake2b(tag + text[at - BLOCK_CHARS : at].encode("utf-8", "surrogatepass"), digest_size=12).digest()
        for at in range(BLOCK_CHARS, len(text) + 1, BLOCK_CHARS)
    )


def block_chains(
    key: ServerKey, links: Sequence[str], blocks: Sequence[Sequence[bytes]], scope: str = ""
) -> tuple[tuple[str, ...], ...]:
    """For each piece i, the chain of its blocks (`text_blocks`) after link i-1 (the key, the scope and the pieces
    before it): two prompts share their first m links of piece i's chain exactly when they share pieces 0..i-1 and
    the first m blocks of piece i. () when `blocks` is not one per piece."""
    if len(blocks) != len(links):
        return ()
    out: list[tuple[str, ...]] = []
    for i, digests in enumerate(blocks):
        previous = bytes.fromhex(links[i - 1]) if i else _seed(key, scope)
        chained: list[str] = []
        for digest in digests:
            previous = hashlib.blake2b(previous + digest, digest_size=16).digest()
            chained.append(previous[:_BLOCK_DIGEST].hex())
        out.append(tuple(chained))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class HeadEntry:
    """One stored head: its file `<id>.head`, the chain of its prompt's pieces and their characters, the tokens its
    prompt took (`prompt_tokens`) and the slot file holds (`saved_tokens`: the prompt and the reply after it)."""

    id: str
    links: tuple[str, ...]
    chars: tuple[int, ...]
    prompt_tokens: int
    saved_tokens: int
    bytes: int
    created_unix: float
    last_used_unix: float
    agent: str | None = None
    project: str | None = None
    restores: int = 0
    key: str = ""  # the ServerKey's hex digest: the heads a restarted server can take back
    crc: str = ""  # the file's CRC-32 when saved: checked before the first restore of each run
    save_pause_ms: float = 0.0  # how long the save paused the server's slots (llama-server saves in its main loop)
    scope: str = ""  # the tenant scope it was saved in (`tenant_scope`): only that scope finds, lists, deletes it
    # "": an agent's head (a session's first turn). Else the session whose whole state this is, saved when the
    # session went idle: a conversation resumed after a restart finds it as its longest match.
    session: str = ""
    # Each piece's block chain (`block_chains`): a prompt that parts from this head inside a piece finds the blocks
    # it shares. (): a head saved before blocks were kept, matched by whole pieces.
    blocks: tuple[tuple[str, ...], ...] = ()

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["links"], out["chars"] = list(self.links), list(self.chars)
        out["blocks"] = [list(b) for b in self.blocks]
        return out

    @staticmethod
    def from_json(raw: Any) -> HeadEntry | None:
        """An index entry, or None when it is not one (a damaged index loses that entry, not the store)."""
        try:
            entry = HeadEntry(
                id=str(raw["id"]),
                links=tuple(str(x) for x in raw["links"]),
                chars=tuple(int(x) for x in raw["chars"]),
                prompt_tokens=int(raw["prompt_tokens"]),
                saved_tokens=int(raw["saved_tokens"]),
                bytes=int(raw["bytes"]),
                created_unix=float(raw["created_unix"]),
                last_used_unix=float(raw["last_used_unix"]),
                agent=raw.get("agent"),
                project=raw.get("project"),
                restores=int(raw.get("restores", 0)),
                key=str(raw.get("key", "")),
                crc=str(raw.get("crc", "")),
                save_pause_ms=float(raw.get("save_pause_ms", 0.0)),
                scope=str(raw.get("scope", "")),
                session=str(raw.get("session", "")),
                blocks=tuple(tuple(str(x) for x in piece) for piece in raw.get("blocks", ())),
            )
        except (KeyError, TypeError, ValueError):
            return None
        ok = entry.id.isalnum() and len(entry.links) == len(entry.chars) > 0
        ok = ok and len(entry.blocks) in (0, len(entry.links))
        return entry if ok else None

    def describe(self) -> dict[str, Any]:
        """What `GET /adaptive/heads` shows: no digest of the prompt."""
        return {
            "id": self.id,
            "agent": self.agent,
            "project": self.project,
            "tokens": self.prompt_tokens,
            "bytes": self.bytes,
            "pieces": len(self.links),
            "created_unix": round(self.created_unix, 3),
            "last_used_unix": round(self.last_used_unix, 3),
            "restores": self.restores,
            "save_pause_ms": round(self.save_pause_ms, 1),
            "session": self.session or None,
        }


def head_id(links: Sequence[str]) -> str:
    return links[-1][:24]


@dataclass(frozen=True, slots=True)
class Match:
    entry: HeadEntry
    pieces: int  # leading pieces shared with the new prompt
    tokens: int  # the tokens of those pieces, estimated from their share of the head's characters
    blocks: int = 0  # and the leading blocks of the next piece it shares (`BLOCK_CHARS` each)


def shared_links(a: Sequence[str], b: Sequence[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def best_match(
    links: Sequence[str], entries: Iterable[HeadEntry], blocks: Sequence[Sequence[str]] = ()
) -> Match | None:
    """The stored head sharing the most tokens with a prompt whose chain is `links` (None: nothing shared). With the
    prompt's `block_chains` (`blocks`), a head it parts from inside a piece also counts the blocks of that piece they
    share: llama-server reuses any common token prefix of a restored slot on a target that can resume anywhere (the
    store passes no blocks for the others: `kv/heads/slot_io.SlotIO.any_prefix`)."""
    best: Match | None = None
    for entry in entries:
        n = shared_links(links, entry.links)
        m = 0
        if n < len(entry.links) and n < len(blocks) and entry.blocks:
            m = shared_links(blocks[n], entry.blocks[n])
        if n == 0 and m == 0:
            continue
        total = sum(entry.chars) or 1
        chars = sum(entry.chars[:n]) + m * BLOCK_CHARS
        tokens = entry.prompt_tokens if n == len(entry.links) else entry.prompt_tokens * chars // total
        if best is None or tokens > best.tokens:
            best = Match(entry, n, tokens, m)
    return best


def covered(links: Sequence[str], entries: Iterable[HeadEntry]) -> bool:
    """Whether a stored head already holds this whole prompt's pieces (saving it again would add nothing)."""
    return any(shared_links(links, e.links) == len(links) for e in entries)


def covered_but_last(links: Sequence[str], chars: Sequence[int], entries: Iterable[HeadEntry]) -> bool:
    """Whether a stored head holds all of this prompt but its last piece, and that piece is a small share of it
    (`LAST_PIECE_SHARE`): another session's first message after the same head. Saving it would add a file of the
    head's size for a few tokens, and push older heads out of the bound."""
    total = sum(chars)
    if len(links) < 2 or not total or chars[-1] > total * LAST_PIECE_SHARE:
        return False
    return any(shared_links(links, e.links) >= len(links) - 1 for e in entries)


def most_recent(entries: Iterable[HeadEntry], key: str, count: int, scope: str = "") -> list[HeadEntry]:
    """The `count` heads of `scope` most recently used under a server key: what a (re)started server gets back."""
    mine = sorted((e for e in entries if e.key == key and e.scope == scope), key=lambda e: -e.last_used_unix)
    return mine[: max(0, count)]


def earlier_states(entries: Iterable[HeadEntry], keep: HeadEntry) -> list[str]:
    """The states of `keep`'s session saved before it: only those its own chain extends (the same server key,
    scope and leading pieces), so the newest alone is kept. A session id is a run's own count (`s000001` again after a
    restart): another run's session of that id, or another tenant's, is another conversation and stays."""
    return [
        e.id
        for e in entries
        if keep.session
        and e.session == keep.session
        and e.id != keep.id
        and e.scope == keep.scope
        and e.key == keep.key
        and shared_links(e.links, keep.links) == len(e.links)
    ]


def evictions(entries: Iterable[HeadEntry], max_bytes: int, incoming_bytes: int = 0) -> list[str]:
    """The least recently used heads to remove so the store (plus one of `incoming_bytes`) fits in `max_bytes`."""
    kept = sorted(entries, key=lambda e: e.last_used_unix)
    total = sum(e.bytes for e in kept) + incoming_bytes
    out: list[str] = []
    for entry in kept:
        if total <= max_bytes:
            break
        out.append(entry.id)
        total -= entry.bytes
    return out


@dataclass(frozen=True, slots=True)
class HeadSize:
    """A head's bytes on disk as the saved heads measure them: a fixed part (what a slot file of a recurrent or
    sliding-window target holds whatever its length: the recurrent state, the context checkpoints) and a part per
    saved token (the attention KV)."""

    fixed_bytes: float
    bytes_per_token: float

    def bytes_for(self, tokens: int) -> int:
        return round(self.fixed_bytes + self.bytes_per_token * max(0, tokens))


def head_size(entries: Iterable[HeadEntry], prior_bytes_per_token: float) -> HeadSize:
    """Fitted to the saved heads' `saved_tokens` and `bytes` by least squares: a fixed part and a part per token where
    their lengths differ; per token alone (their bytes over their tokens) where they do not, or where the fit makes a
    part negative (heads of different models mixed); `prior_bytes_per_token` without heads."""
    points = [(e.saved_tokens, e.bytes) for e in entries if e.saved_tokens > 0]
    if not points:
        return HeadSize(0.0, prior_bytes_per_token)
    ratio = HeadSize(0.0, sum(b for _, b in points) / sum(t for t, _ in points))
    mean_t = sum(t for t, _ in points) / len(points)
    mean_b = sum(b for _, b in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread == 0:
        return ratio
    per_token = sum((t - mean_t) * (b - mean_b) for t, b in points) / spread
    fixed = mean_b - per_token * mean_t
    return HeadSize(fixed, per_token) if per_token > 0 and fixed >= 0 else ratio


@dataclass(frozen=True, slots=True)
class RestorePrice:
    pays: bool
    restore_s: float
    prefill_s: float
    gain_tokens: int


def price(match: Match, slot_tokens: int, prefill: PrefillRate, restore_bytes_per_s: float) -> RestorePrice:
    """A restore pays when it brings `MIN_GAIN_TOKENS` more than the slot holds and reading the file (the whole
    slot: the head and the turn after it) takes less than prefilling those tokens (after the ones the slot holds)."""
    gain = match.tokens - max(0, slot_tokens)
    restore_s = RESTORE_OVERHEAD_S + match.entry.bytes / max(1.0, restore_bytes_per_s)
    prefill_s = prefill.seconds(max(0, gain), max(0, slot_tokens))
    return RestorePrice(gain >= MIN_GAIN_TOKENS and restore_s < prefill_s, restore_s, prefill_s, gain)


def inert(expected_tokens: int, cache_n: int) -> bool:
    """A restore the next prompt barely reused (llama.cpp #26676: success reported, the prompt re-prefilled)."""
    return cache_n < expected_tokens * INERT_SHARE
