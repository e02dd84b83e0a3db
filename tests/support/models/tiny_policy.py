"""A policy for launched servers of the tests' tiny model: the KV handoff priors its slot files really take.

`serve` measures the servers it launches (requests/measured_speeds.py): the tiny model prefills ~26,000 tokens a
second on one core, so a re-prefill of a few hundred tokens is estimated cheaper than a handoff at the policy's priors
(0.04 s per 1,000 tokens saved, 0.02 s a restore: a real model's slot files, megabytes a thousand tokens). The tiny
model's are kilobytes, saved and restored in about a millisecond: tests that move its KV between servers say so."""

from __future__ import annotations

from pathlib import Path

TINY_HANDOFF = "[handoff]\nsave_s_per_1k = 0.001\nrestore_s = 0.001\n"


def tiny_policy(home: Path, extra: str = "") -> Path:
    """A policy file in `home` with the tiny model's handoff priors (and `extra` TOML after them)."""
    path = home / "tiny-policy.toml"
    home.mkdir(parents=True, exist_ok=True)
    path.write_text(TINY_HANDOFF + extra)
    return path
