"""Which event loop the proxy runs on: Python's own asyncio loop, or uvloop's (libuv) when asked and installed.

Measured side by side (benchmarks/overhead/side_by_side.py --loops, docs/benchmarks.md "Event loops"): on uvloop the
proxy used 5-10% less CPU per request but answered no sooner (time to first chunk the same or up to 12% later at one
and eight streams, tiny and 120k-token bodies), and the floors gained nothing either: the time goes to aiohttp's
parser (C already) and the proxy's own Python, not to the loop. So the default stays Python's loop; uvloop is an option.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from adaptive_spec.errors import ConfigError

EVENT_LOOPS = ("asyncio", "uvloop")


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory of the loop to run on; None: Python's own."""
    if choice not in EVENT_LOOPS:
        raise ConfigError(f"--event-loop {choice}: choose one of {', '.join(EVENT_LOOPS)}")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        raise ConfigError("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def loop_name() -> str:
    """The running loop, as the start-up lines name it."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"
