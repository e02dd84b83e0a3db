"""Carrying out the KV move a route asks for: the session's slot handed over, a stored head restored into its slot, or
its prompt prefilled elsewhere, through the shell's `Mover`, and the result reported back to the router with `moved()`
(the router plans and never waits: llama-swap's scheduler hears back as an event)."""

from __future__ import annotations

from typing import Protocol

from adaptive_spec.kv.heads.values import Restored
from adaptive_spec.kv.moves import HandoffResult, HeadRestore, PrefillAsk, RemotePrefillResult, SlotMove
from adaptive_spec.routing.contract import Completion, Route
from adaptive_spec.routing.router import Router


class Mover(Protocol):
    """The KV moves the request path carries out for the router (implemented by `kv/effects.py`, given to the handler
    when the proxy is built); none of it raises into a request."""

    async def move_slot(self, move: SlotMove) -> HandoffResult:
        """Save the session's slot where its KV lives, restore it where the request goes."""
        ...

    async def prefill_elsewhere(self, ask: PrefillAsk) -> RemotePrefillResult | None:
        """None: not prefilled elsewhere (no remote prefill here for this server)."""
        ...


class HeadRestorer(Protocol):
    """A head restore carried out (the head store's: `requests/heads.py`'s `restorer`); it never raises."""

    async def restore_head(self, move: HeadRestore) -> Restored | None:
        """None: not restored (a busy slot, the store's lock held too long, a damaged file): the request prefills."""
        ...


async def carry_out(router: Router, mover: Mover, route: Route, heads: HeadRestorer | None = None) -> Route:
    """The route with its move carried out through `mover` (a head restore through `heads`; None: no store, or the
    request is not its session's first there, as the store counted it when the route came back: not made) and
    reported to `router` (the route as it was when it asks for none, or its move was already folded). A client that
    goes away meanwhile completes the route: no route reaches the forward."""
    move = route.move
    if move is None or route.handoff is not None or route.remote_prefill is not None or route.restored is not None:
        return route
    try:
        if isinstance(move, SlotMove):
            return router.moved(route, await mover.move_slot(move))
        if isinstance(move, HeadRestore):
            return router.moved(route, await heads.restore_head(move) if heads is not None else None)
        return router.moved(route, await mover.prefill_elsewhere(move))
    except BaseException:
        router.complete(route, Completion(ok=False))
        raise
