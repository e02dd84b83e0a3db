"""What a slot file's trip between two hosts costs: KV bytes per token × tokens ÷ the link's bandwidth.

What prefilling the tokens instead costs is the router's speed model's to say: it hands it over as a `PrefillRate`.
Pure, and the one model both KV moves use: a handoff between hosts (the router's speed model prices it) and remote
prefill (its cost model), each over its own link.

KV bytes per token is a fact of the model and its cache type, not a noisy figure: the first file measured replaces
the prior. The link is averaged as seconds per byte (time is what adds up); its prior is the start-up probe of the
link when there was one, else ~1 Gbit/s.
"""

from __future__ import annotations

from dataclasses import dataclass

from adaptive_spec.common.means import RunningMean

# Until measured: a 27B-class model's f16 KV per token, over ~1 Gbit/s.
KV_BYTES_PER_TOKEN_PRIOR = 120_000.0
BANDWIDTH_PRIOR_BYTES_PER_S = 100e6
MIN_TRANSFER_BYTES = 65_536  # smaller files time the round trip, not the link
_LINK_PRIOR_WEIGHT = 2.0


@dataclass(frozen=True, slots=True)
class PrefillRate:
    """A server's prefill cost as the speed model has it now (`routing/prefill_line.py`): a prompt token at position
    p takes `a_s + b_s_per_1k · p/1000` seconds. What every KV move compares its cost with (a head restore, a remote
    prefill), so each prices the prefill it saves at the positions it saves it."""

    a_s: float
    b_s_per_1k: float = 0.0

    def seconds(self, new: float, cached: float = 0.0) -> float:
        """Prefilling `new` tokens after `cached` ones the slot holds."""
        if new <= 0:
            return 0.0
        return new * (self.a_s + self.b_s_per_1k * (max(0.0, cached) + (new - 1) / 2.0) / 1000.0)


class LinkCosts:
    def __init__(
        self,
        forget: float,
        bytes_per_token_prior: float = KV_BYTES_PER_TOKEN_PRIOR,
        bandwidth_prior_bytes_per_s: float = BANDWIDTH_PRIOR_BYTES_PER_S,
    ) -> None:
        self._bytes_prior, self._link_bytes_per_s = bytes_per_token_prior, bandwidth_prior_bytes_per_s
        self._bytes_per_token = RunningMean(0.0, forget)
        self._s_per_byte = RunningMean(_LINK_PRIOR_WEIGHT, forget)

    def set_forget(self, forget: float) -> None:
        self._bytes_per_token.forget = self._s_per_byte.forget = forget

    def bytes_per_token(self) -> float:
        return self._bytes_per_token.value(self._bytes_prior)

    def bandwidth_bytes_per_s(self) -> float:
        return 1.0 / self._s_per_byte.value(1.0 / self._link_bytes_per_s)

    def transfer_s(self, tokens: float) -> float:
        """A slot file of `tokens` over this link."""
        return max(0.0, tokens) * self.bytes_per_token() / self.bandwidth_bytes_per_s()

    def observe_link(self, bytes_per_s: float | None) -> None:
        """A probe of the link (at start-up): the bandwidth's prior until moves measure it."""
        if bytes_per_s is not None and bytes_per_s > 0:
            self._link_bytes_per_s = bytes_per_s

    def observe_transfer(self, tokens: int, file_bytes: int, seconds: float) -> None:
        """A slot file that crossed the link: its bytes per token, and the link's speed when the file is big enough."""
        if tokens > 0 and file_bytes > 0:
            self._bytes_per_token.add(file_bytes / tokens)
        if file_bytes >= MIN_TRANSFER_BYTES and seconds > 0:
            self._s_per_byte.add(seconds / file_bytes)

    def describe(self) -> dict[str, float]:
        return {
            "bytes_per_token": round(self.bytes_per_token(), 1),
            "bandwidth_mb_per_s": round(self.bandwidth_bytes_per_s() / 1e6, 2),
        }
