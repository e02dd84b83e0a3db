"""Which session a request belongs to: explicit ids first, then the reply echo, then an opening turn seen under another
system prompt moments before, else a new session.

Pure and synchronous: the proxy hands in headers and the parsed body, and tells the registry what it served.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import time
from array import array
from collections.abc import Callable, Iterator, KeysView, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from adaptive_spec.common.headers import PARENT_SESSION_HEADERS, SESSION_HEADERS, SUBAGENT_HEADERS
from adaptive_spec.common.lru import LRU
from adaptive_spec.sessions.messages import message_text, messages_of, text_digest, tool_call_ids

# Lines shorter than this are too common ("return x", "}") to say which session served them.
_MIN_ECHO_LINE = 24
_MAX_LINES_PER_REPLY = 400
# The reply echo's bound, each of its two maps (`serve --echo-fingerprints`): ~70 MiB together when both are full
# (~180 B an entry, measured with tracemalloc), reached after about as many served replies.
ECHO_FINGERPRINTS = 200_000
_AMBIGUOUS = ""
# A text from this size on keeps its echo lines' keys (a message sent again, in any session, is not read again: a
# request without a session id brings its whole history each time, most of it short messages): at most this many
# texts, and this many keys in all (8 bytes each; each kept twice, in order and sorted). ~13 MiB when full of short
# texts. A shorter text is read each time (a few lines: cheaper than looking it up).
_SCAN_CACHE_CHARS = 256
_SCAN_CACHE_TEXTS = 32_768
_SCAN_CACHE_KEYS = 1_000_000
# Sessions whose id the fingerprints share (one string a session, not a copy per reply: see `SessionRegistry`).
_SHARED_IDS = 10_000
# First requests that got no answer (the client gave up), kept so that the client's retry joins their session.
_UNANSWERED = 1024
# Conversations' opening turns (their user messages, no reply yet), kept this long so that a request opening with the
# same turn under another system prompt joins them: Gemini CLI asks its model router's classifier about the user's
# first message, then sends the conversation itself (neither names a session).
_OPENINGS = 1024
OPENING_S = 300.0


@dataclass(frozen=True, slots=True)
class SessionAssignment:
    session_id: str
    # "header:<name>", "body:<field>", "echo:reply", "echo:tool-call", "echo:lines", "retry", "opening", "new"
    source: str
    parent_id: str | None = None
    subagent: bool = False


def _echo_lines(text: str) -> Iterator[str]:
    for line in text.splitlines():
        line = line.strip().lstrip("+-> ").strip()
        if len(line) >= _MIN_ECHO_LINE:
            yield line


# An echo line's key in the served-lines table: Python's keyed string hash (process-local, as the table is), ~10x
# cheaper than a digest; 64 bits, so a false match among 200,000 served lines is ~1e-14 a line.
_line_key = hash


def _conversation_digest(body: Mapping[str, Any]) -> bytes | None:
    """The digest of a request's conversation as the client sent it (its system field, messages, input, prompt);
    None for a body with none of them."""
    parts = [body.get(name) for name in ("system", "messages", "input", "prompt")]
    if not any(parts):
        return None
    try:
        text = orjson.dumps(parts)
    except TypeError:
        text = repr(parts).encode()
    return hashlib.blake2b(text, digest_size=12).digest()


def _opening(headers: Mapping[str, str], body: Mapping[str, Any]) -> tuple[bytes, bytes] | None:
    """(digest of a conversation's opening turn as this client sent it, digest of its system prompt) for a request
    that holds user turns and nothing served yet (no assistant or tool message); None otherwise. The user messages'
    texts are joined as one turn of several parts is (`message_text`), so an opening sent as two messages reads as the
    same turn. The client's User-Agent is part of it: two agents given the same first prompt are two conversations."""
    messages = messages_of(body)
    users, system = [], []
    for message in messages:
        role = message.get("role", "user")
        text = message_text(message.get("content"))
        if role in ("system", "developer"):
            system.append(text)
        elif role == "user":
            users.append(text)
        else:
            return None
    for name in ("system", "instructions"):
        if isinstance(body.get(name), str | list):
            system.append(message_text(body.get(name)))
    turn = "\n".join(users)
    if len(turn.strip()) < _MIN_ECHO_LINE:
        return None  # "hi": too common an opening to say which conversation it is
    sent = f"{headers.get('user-agent', '')}\0{turn}"
    digest = hashlib.blake2b(sent.encode("utf-8", "surrogatepass"), digest_size=12).digest()
    return digest, hashlib.blake2b("\0".join(system).encode("utf-8", "surrogatepass"), digest_size=12).digest()


def echo_line_keys(text: str) -> array[int]:
    """The keys of a text's echo lines (`_echo_lines`, in one pass), each once, in the order they first appear."""
    lines = [line.strip().lstrip("+-> ").strip() for line in text.splitlines()]
    return array("q", dict.fromkeys([_line_key(line) for line in lines if len(line) >= _MIN_ECHO_LINE]))


def _call_key(call_id: str) -> tuple[str, int]:
    """A served tool call's key among the replies' digests: its id's keyed hash (process-local, as the table is; a
    request carries back every call of its history, each looked up)."""
    return ("tool-call", hash(call_id))


def explicit_session(headers: Mapping[str, str], body: Mapping[str, Any]) -> tuple[str, str] | None:
    """(session id, source) from headers or body ids, or None. `headers` keys must be lower-case."""
    for name in SESSION_HEADERS:
        if headers.get(name):
            return headers[name], f"header:{name}"
    for name, value in headers.items():
        if name.startswith("x-") and name.endswith("-session-id") and name not in PARENT_SESSION_HEADERS and value:
            return value, f"header:{name}"
    key = body.get("prompt_cache_key")
    if isinstance(key, str) and key:
        return key, "body:prompt_cache_key"
    for holder in ("client_metadata", "metadata"):
        meta = body.get(holder)
        if isinstance(meta, dict) and isinstance(meta.get("session_id"), str) and meta["session_id"]:
            return meta["session_id"], f"body:{holder}.session_id"
    meta = body.get("metadata")
    if isinstance(meta, dict):
        found = _user_id_session(meta.get("user_id"))
        if found:
            return found, "body:metadata.user_id"
    user = body.get("user")
    if isinstance(user, str) and user:
        return user, "body:user"
    return None


def _user_id_session(user_id: Any) -> str | None:
    """The session id in Anthropic's `metadata.user_id` as Claude Code writes it: a JSON object in a string
    (`{"device_id": …, "session_id": …}`, 2.1 and later), or `user_<hash>_account_<uuid>_session_<uuid>` before."""
    if not isinstance(user_id, str) or not user_id:
        return None
    if user_id.startswith("{"):
        try:
            parsed = json.loads(user_id)
        except ValueError:
            return None
        session = parsed.get("session_id") if isinstance(parsed, dict) else None
        return session if isinstance(session, str) and session else None
    if "_session_" in user_id:
        return user_id.split("_session_", 1)[1] or user_id
    return None


# The newest served replies and tool calls of a request another proxy may have served (a lookup in the shared state).
_SHARED_ECHOES = 8


def echo_candidates(body: Mapping[str, Any]) -> list[str]:
    """The keys of a request's newest assistant replies and tool calls, newest first, as the proxies that share state
    name what they served (`served_keys`): the ones another proxy may have answered."""
    keys: list[str] = []
    for message in reversed(messages_of(body)):
        keys += [f"call:{call_id}" for call_id in tool_call_ids(message)]
        if message.get("role") == "assistant":
            text = message_text(message.get("content"))
            if text.strip():
                keys.append("reply:" + text_digest(text).hex())
        if len(keys) >= _SHARED_ECHOES:
            break
    return keys[:_SHARED_ECHOES]


def served_keys(text: str, call_ids: Sequence[str]) -> list[str]:
    """The keys of what was served (a reply's text, its tool calls) in the shared state (`echo_candidates`)."""
    said = ["reply:" + text_digest(text).hex()] if text.strip() else []
    return said + [f"call:{call_id}" for call_id in call_ids]


class _Scan:
    """A long text's echo line keys (in order, and sorted to look one up), and how far into the served-lines log
    it is known to quote none of them: a text sent again is tested only against the lines served since (-1: not
    known)."""

    __slots__ = ("_sorted", "clear_to", "keys")

    def __init__(self, keys: array[int]) -> None:
        self.keys = keys
        self._sorted: array[int] | None = None  # sorted when first looked into: most texts are never sent again
        self.clear_to = -1

    def __len__(self) -> int:
        return len(self.keys)

    def holds(self, key: int) -> bool:
        if self._sorted is None:
            self._sorted = array("q", sorted(self.keys))
        at = bisect.bisect_left(self._sorted, key)
        return at < len(self._sorted) and self._sorted[at] == key


class SessionRegistry:
    """Sessions by id, plus a bounded map from served-reply fingerprints to the session that got them.

    The maps fill at one entry a served reply and one a served line until their bound, so each entry holds as
    little as it can: its key, and the one id string of its session (a session id arrives as a new string with
    every request's headers or body; a copy per entry was a quarter of the maps' memory)."""

    def __init__(
        self, max_fingerprints: int = ECHO_FINGERPRINTS, clock: Callable[[], float] = time.monotonic, run: str = ""
    ) -> None:
        self._replies: LRU[bytes | tuple[str, int], str] = LRU(max(1, max_fingerprints))
        self._lines: LRU[int, str] = LRU(max(1, max_fingerprints))
        self._ids: LRU[str, str] = LRU(_SHARED_IDS)  # a session id -> the string its entries share
        # Texts seen before (any session's, any role): their echo lines' keys, so no text is read for lines twice.
        self._scans: LRU[tuple[int, int], _Scan] = LRU(
            _SCAN_CACHE_TEXTS, max_weight=_SCAN_CACHE_KEYS, weigh=lambda scan: 2 * len(scan)
        )
        # Each key as it joins the served lines (again after it was dropped), from position `_log_start` on.
        self._served_log: array[int] = array("q")
        self._log_start = 0
        self._log_limit = 2 * max(1, max_fingerprints)  # 8 bytes a key; past it the older half goes
        self._unanswered: LRU[bytes, str] = LRU(_UNANSWERED)
        # An opening turn -> (its session, the system prompt it came with, when).
        self._openings: LRU[bytes, tuple[str, bytes, float]] = LRU(_OPENINGS)
        self._clock = clock
        self._counter = itertools.count(1)
        # The run's own tag on the ids it makes up (`serve` gives a random one): `s000001` of one run is not the
        # session of that name a run before it left in the head store.
        self._run = f"-{run}" if run else ""

    def assign(self, headers: Mapping[str, str], body: Mapping[str, Any]) -> SessionAssignment:
        parent = next((headers[h] for h in PARENT_SESSION_HEADERS if headers.get(h)), None)
        subagent = parent is not None or any(headers.get(h) for h in SUBAGENT_HEADERS)
        found = explicit_session(headers, body)
        if found is not None:
            return SessionAssignment(found[0], found[1], parent, subagent)
        echoed = self._echo(body)
        if echoed is not None:
            return SessionAssignment(echoed[0], echoed[1], parent, subagent)
        if parent is not None:
            return SessionAssignment(parent, "header:parent", parent, True)
        retried = self._unanswered.pop(digest) if self._unanswered and (digest := _conversation_digest(body)) else None
        if retried is not None:
            return SessionAssignment(retried, "retry", None, subagent)
        opening = _opening(headers, body)
        joined = self._opened(opening) if opening is not None else None
        if joined is not None:
            return SessionAssignment(joined, "opening", None, subagent)
        session_id = f"s{next(self._counter):06d}{self._run}"
        if opening is not None:
            self._openings.put(opening[0], (session_id, opening[1], self._clock()))
        return SessionAssignment(session_id, "new", None, subagent)

    def _opened(self, opening: tuple[bytes, bytes]) -> str | None:
        """The session a recent conversation opened with this turn under another system prompt (a side request of it
        sent first, or the conversation after its side request). Under the same system prompt it is the user asking
        again: a conversation of its own."""
        known = self._openings.get(opening[0])
        if known is None or known[1] == opening[1] or self._clock() - known[2] > OPENING_S:
            return None
        return known[0]

    def note_unanswered(self, assignment: SessionAssignment, body: Mapping[str, Any]) -> None:
        """A conversation's first request ended with no answer (an agent that gives up on a long prefill sends it
        again): the same request, sent again, joins its session instead of starting one. Once, then forgotten. A
        first request that joined its conversation by its opening turn counts as one (Gemini CLI's, after its
        classifier: it gave up on it after 300 s of prefill on a loaded CPU, and its retry started a session of its
        own)."""
        digest = _conversation_digest(body) if assignment.source in ("new", "opening") else None
        if digest is not None:
            self._unanswered.put(digest, assignment.session_id)

    def note_reply(self, session_id: str, text: str, tool_call_ids: list[str]) -> None:
        """Remember what the proxy served, so a later request that carries it back is grouped with it."""
        said = bool(text.strip())
        if not said and not tool_call_ids:
            return
        session_id = self._ids.get(session_id) or session_id
        self._ids.put(session_id, session_id)
        if said:
            self._put(self._replies, text_digest(text), session_id)
            for line in itertools.islice(dict.fromkeys(_echo_lines(text)), _MAX_LINES_PER_REPLY):
                key = _line_key(line)
                if key not in self._lines:
                    self._served_log.append(key)
                self._put(self._lines, key, session_id)
            if len(self._served_log) > self._log_limit:
                drop = len(self._served_log) // 2
                del self._served_log[:drop]
                self._log_start += drop
        for call_id in tool_call_ids:
            self._put(self._replies, _call_key(call_id), session_id)

    def heard(self, served: Mapping[str, str]) -> None:
        """What other proxies served, by the keys of `echo_candidates` (read from the shared state before `assign`):
        a request that carries it back joins its session here too."""
        for key, session_id in served.items():
            kind, _, value = key.partition(":")
            if kind == "reply":
                try:
                    self._put(self._replies, bytes.fromhex(value), session_id)
                except ValueError:
                    continue
            elif kind == "call":
                self._put(self._replies, _call_key(value), session_id)

    def _put(self, table: LRU[Any, str], key: Any, session_id: str) -> None:
        # Text served to two sessions (a stock phrase, a shared snippet) says nothing about either: mark it void.
        previous = table.get(key)
        table.put(key, session_id if previous in (None, session_id) else _AMBIGUOUS)

    def _line_keys(self, text: str) -> Sequence[int] | _Scan:
        """`echo_line_keys(text)`, remembered for a text of a few lines or more: read once, however many requests
        carry it."""
        if len(text) < _MIN_ECHO_LINE:
            return ()
        if len(text) < _SCAN_CACHE_CHARS:
            return echo_line_keys(text)
        at = (len(text), hash(text))
        scan = self._scans.get(at)
        if scan is None:
            scan = _Scan(echo_line_keys(text))
            self._scans.put(at, scan)
        return scan

    def _quotes_none(self, keys: Sequence[int] | _Scan, served: KeysView[int]) -> bool:
        """Whether a text quotes no served line. A long text found so before is tested only against the lines
        served since (a history sent again is mostly texts tested on its last turn)."""
        if not isinstance(keys, _Scan):
            return served.isdisjoint(keys)
        end = self._log_start + len(self._served_log)
        if keys.clear_to == end:
            return True
        since = keys.clear_to - self._log_start
        if keys.clear_to >= 0 and since >= 0 and (end - keys.clear_to) * 16 < len(keys):
            none = not any(k in served and keys.holds(k) for k in self._served_log[since:])
        else:
            none = served.isdisjoint(keys.keys)
        if none:
            keys.clear_to = end
        return none

    def _echo(self, body: Mapping[str, Any]) -> tuple[str, str] | None:
        messages = messages_of(body)
        # Strongest: a whole assistant reply or a tool-call id we served, newest first.
        for message in reversed(messages):
            for call_id in tool_call_ids(message):
                hit = self._replies.get(_call_key(call_id))
                if hit:
                    return hit, "echo:tool-call"
            if message.get("role") == "assistant":
                hit = self._replies.get(text_digest(message_text(message.get("content"))))
                if hit:
                    return hit, "echo:reply"
        return self._line_echo(messages)

    def _line_echo(self, messages: list[dict[str, Any]]) -> tuple[str, str] | None:
        """Rewritten histories and side requests (a commit message for a diff) still quote served lines.

        Lines that also appear in a system prompt are ignored: unrelated sessions of one client share those.
        """
        system: set[int] = set()
        quoted: list[Sequence[int] | _Scan] = []
        for message in messages:
            keys = self._line_keys(message_text(message.get("content")))
            if message.get("role") in ("system", "developer"):
                system.update(keys.keys if isinstance(keys, _Scan) else keys)
            else:
                quoted.append(keys)
        served = self._lines.keys()  # whether a request quotes any served line: one C-level test per message
        if all(self._quotes_none(keys, served) for keys in quoted):
            return None  # the usual answer (a new conversation), found without a lookup per line
        votes: dict[str, int] = {}
        for found in quoted:
            for key in found.keys if isinstance(found, _Scan) else found:
                hit = self._lines.get(key) if key in served and key not in system else None
                if hit:
                    votes[hit] = votes.get(hit, 0) + 1
        if not votes:
            return None
        best, count = max(votes.items(), key=lambda kv: kv[1])
        return (best, "echo:lines") if count >= 2 else None
