"""A running mean with a prior worth `weight` observations and exponential forgetting: the one way every learned
figure (speeds, slot save and restore, a link's bandwidth, a remote server's prefill) is averaged."""

from __future__ import annotations


class RunningMean:
    __slots__ = ("forget", "n", "total", "weight")

    def __init__(self, weight: float, forget: float) -> None:
        self.weight, self.forget = weight, forget
        self.total = 0.0
        self.n = 0.0

    def add(self, value: float) -> None:
        self.total = self.total * self.forget + value
        self.n = self.n * self.forget + 1.0

    def value(self, prior: float) -> float:
        if self.weight + self.n <= 0:
            return prior
        return (prior * self.weight + self.total) / (self.weight + self.n)
