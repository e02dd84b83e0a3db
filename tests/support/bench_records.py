"""Bench records with a known answer, for the tests of the bench's statistics and of its outputs."""

from __future__ import annotations

import random
from typing import Any


def record(profile: str, index: int, round_: int, tok_s: float, ttst: float, accepted: int = 0) -> dict[str, Any]:
    """One finished bench request: 100 tokens at `tok_s`, second token after `ttst` ms."""
    return {
        "profile": profile,
        "served_profile": profile,
        "outcome": "finished",
        "index": index,
        "round": round_,
        "ttst_ms": ttst,
        "timings": {"predicted_n": 100, "predicted_ms": 100 / tok_s * 1000, "draft_n_accepted": accepted},
    }


def two_statics_and_adaptive(adaptive_speed: float) -> list[dict[str, Any]]:
    """Two statics: `iterative` twice as fast as `oneshot` on every request, and an adaptive pass."""
    rng = random.Random(8)
    out = []
    for round_ in (0, 1):
        for i in range(8):
            wobble = rng.uniform(0.9, 1.1)
            out += [
                record("oneshot", i, round_, 40 * wobble, 30.0),
                record("iterative", i, round_, 80 * wobble, 60.0, accepted=50),
                record("adaptive", i, round_, adaptive_speed * wobble, 45.0, accepted=50),
            ]
    return out
