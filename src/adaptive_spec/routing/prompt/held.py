"""What each llama-server holds of prompts beyond a session's own state, as the router remembers it: the request each
slot served last (whichever session), each session's side lines as last served and where, and each server's last
request under each system prompt (its RAM cache of prompts).

Pure and synchronous: the router reads it while it plans a request's new tokens, and tells it what a request served
in full left there, what a slot action overwrote and which servers' slots were emptied. A server is named by its
home, the (profile, replica) whose server it is (`ServerBooks.home`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from adaptive_spec.common.lru import LRU
from adaptive_spec.routing.prompt.prefix import PrefixState, line_of

# llama-server loads a prompt of its RAM cache into a slot only where the new prompt keeps this share of it
# (`server_prompt_cache::load`, b11549: "don't trash large prompts").
RAM_LOAD_SHARE = 0.25
Home = tuple[str, int]
SideLine = tuple[Home, PrefixState]


class HeldPrompts:
    def __init__(self) -> None:
        # What each slot served last, whichever session: a new session of the same agent shares its system prompt.
        # Keyed by the server's home and the slot (None: the server's only slot).
        self._slots: LRU[tuple[str, int, int | None], PrefixState] = LRU(4096)
        # Each session's side lines (another system prompt: a subagent's conversation, a recurring side request) as
        # last served, and the server that served it: llama-server keeps their prompts in its RAM cache, as the main
        # line's, and takes them back when one goes on (a side request sent again prefills 1 token).
        self._sides: LRU[tuple[str, bytes], SideLine] = LRU(4096)
        # Each server's last request under each system prompt, whichever session: a request that took its slot over
        # left it in the RAM cache, where a recurring request sent as a new session each time finds it (Gemini CLI's
        # model-router classifier prefills ~13 of ~800 tokens).
        self._recent: LRU[tuple[str, int, bytes], PrefixState] = LRU(1024)

    def in_slot(self, home: Home, slot: int | None) -> PrefixState | None:
        """What the slot served last (`slot` None: the server's only slot)."""
        return self._slots.get((*home, slot))

    def side(self, session_id: str | None, line: bytes | None) -> SideLine | None:
        """The session's side line under the system prompt `line`, as last served, and where."""
        return self._sides.get((session_id, line)) if session_id is not None and line is not None else None

    def in_ram(
        self, home: Home, line: bytes | None, side: SideLine | None, held: PrefixState | None
    ) -> tuple[PrefixState, ...]:
        """What the RAM cache of the server `home` may hold of a prompt under the system prompt `line`: the session's
        side line's last request there, and the last request of any session under it there (not the slot's own)."""
        out = [side[1]] if side is not None and side[0] == home else []
        recent = self._recent.get((*home, line)) if line is not None else None
        if recent is not None and recent is not held:
            out.append(recent)
        return tuple(out)

    def loadable(
        self,
        home: Home,
        slot: int | None,
        line: bytes | None,
        side: SideLine | None,
        state: PrefixState | None,
        shared: Callable[[PrefixState | None], int],
    ) -> Iterator[tuple[int, PrefixState | None]]:
        """What the server `home` may start a prompt under the system prompt `line` from, each with the tokens it
        shares with the prompt (`shared`): what `slot` served last, and what its RAM cache holds (`in_ram`) where
        llama-server would load it. `state`: the session's own, loaded whatever it shares."""
        held = self.in_slot(home, slot)
        yield shared(held), held
        for other in self.in_ram(home, line, side, held):
            tokens = shared(other)
            if other is not state and other is not held and tokens < RAM_LOAD_SHARE * other.prompt_tokens:
                continue  # llama-server loads a cached prompt only where the request keeps enough of it
            yield tokens, other

    def served(
        self,
        home: Home,
        slot: int | None,
        state: PrefixState,
        session_id: str | None,
        side: bool,
        left: tuple[Home, PrefixState] | None = None,
    ) -> None:
        """A request served in full on the server `home` left `state` in `slot` (None: its only slot), and as that
        server's last under its system prompt; a side request's as its session's side line. A main line's request:
        `left` is where its session's line was before and what it held there (None: nowhere its KV was kept)."""
        self._slots.put((*home, slot), state)
        line = line_of(state.pieces)
        if line is not None:
            self._recent.put((*home, line), state)
        if session_id is None:
            return
        if side:
            if line is not None:
                self._sides.put((session_id, line), (home, state))
            return
        self._line_left(session_id, line, left)

    def overwritten(self, home: Home, slot: int | None) -> None:
        """A slot action overwrote the slot: the request it served last is in neither the slot nor the RAM cache."""
        self._forget(home, self._slots.pop((*home, slot)))

    def erased(self, home: Home) -> None:
        """The server's slots were emptied: what each slot served last is gone (its RAM cache may remain)."""
        for key in [k for k in self._slots if k[:2] == home]:
            self._forget(home, self._slots.pop(key))

    def _forget(self, home: Home, gone: PrefixState | None) -> None:
        line = line_of(gone.pieces) if gone is not None else None
        if line is not None and self._recent.get((*home, line)) is gone:
            self._recent.pop((*home, line))

    def _line_left(self, session_id: str, now: bytes | None, left: tuple[Home, PrefixState] | None) -> None:
        """The session's line was served under the system prompt `now`: its last prompt under another one (kept by
        llama-server's RAM cache when this request took the slot, unless a slot action had overwritten it) is kept
        as that system prompt's line; the one under this system prompt is in the slot now, out of the RAM cache."""
        if now is not None:
            self._sides.pop((session_id, now))
        if left is None:
            return
        home, own = left
        old = line_of(own.pieces)
        if old is None or old == now:
            return
        self._sides.put((session_id, old), (home, own))
