"""The prefill cost that grows with the context: a prompt token at position p prefills in a + b·p seconds (attention
reads every token before it: on Qwen2.5-Coder-0.5B on 2 CPU cores a token at 15k costs about six times one at 1k),
fitted from llama-server's own timings.

Pure. N new tokens after C cached ones cost N·(a + b·(C + (N−1)/2)); a request's `prompt_ms` over its `prompt_n` is one
point of that line at the mean position of the tokens it prefilled.
"""

from __future__ import annotations

from adaptive_spec.kv.costs import PrefillRate


class PrefillLine:
    """Ridge regression of a request's prefill seconds per token on the mean position of its new tokens (in thousands):
    y = a + b·m, one point per request, its `prompt_ms` over `prompt_n` at m = (C + (N−1)/2)/1000 after C cached."""

    __slots__ = ("n", "s1", "sm", "smm", "smy", "sy")

    def __init__(self) -> None:
        self.s1 = self.sm = self.smm = self.sy = self.smy = self.n = 0.0

    @staticmethod
    def mean_position_k(cached: int, new: int) -> float:
        return (max(0, cached) + max(0, new - 1) / 2.0) / 1000.0

    def add(self, cached: int, new: int, seconds: float, forget: float, weight: float = 1.0) -> None:
        m, y = self.mean_position_k(cached, new), seconds / new
        self.s1 = self.s1 * forget + weight
        self.sm = self.sm * forget + weight * m
        self.smm = self.smm * forget + weight * m * m
        self.sy = self.sy * forget + weight * y
        self.smy = self.smy * forget + weight * m * y
        self.n = self.n * forget + weight

    def solve(self, a0: float, slowdown: float, weight: float) -> PrefillRate:
        """(a, b) minimising Σ(y − a − b·m)² + weight·((a − a0)² + (b − slowdown·a)²): the slope's prior is a share
        of the intercept, so a machine measured slower at the start is slower at 16k too. Never a negative slope."""
        p = self.s1 + weight * (1.0 + slowdown * slowdown)
        q = self.sm - weight * slowdown
        t = self.smm + weight
        u, v = self.sy + weight * a0, self.smy
        det = p * t - q * q
        if det <= 1e-18:  # one position measured and no prior: a flat line through it
            a = self.sy / self.s1 if self.s1 > 0 else a0
            return PrefillRate(a, 0.0)
        a, b = (u * t - q * v) / det, (p * v - q * u) / det
        if b < 0.0:  # noise over a short range of positions: the flat line's intercept
            a, b = u / (self.s1 + weight), 0.0
        return PrefillRate(max(a, 1e-9), b)

    def state(self) -> list[float]:
        return [self.s1, self.sm, self.smm, self.sy, self.smy, self.n]

    def load(self, values: list[float]) -> None:
        self.s1, self.sm, self.smm, self.sy, self.smy, self.n = (float(v) for v in values)
