"""Remote prefill: whether a long prompt is prefilled on a bigger machine (`serve --pp-server`) and its KV cache brought
back, or prefilled here.

Pure: the proxy's shell (`kv/remote_prefill/shell.py`) measures, this decides.

    local:   the new prompt tokens after the cached ones, on the local prefill line   (the router's speed model)
    remote:  round trip + all prompt tokens × remote prefill seconds/token
             + save + slot file bytes ÷ bandwidth + restore             (bytes = bytes/token × all prompt tokens)

The remote prices ALL the prompt's tokens: the slot file holds the whole context, and a remote server keeps no
promise to still hold an earlier turn. Remote is chosen when it is faster by the margin (and the prompt has at least
`min_tokens` new tokens); every term is a running average of measurements, starting from a prior.
"""

from __future__ import annotations

from dataclasses import dataclass

from adaptive_spec.common.means import RunningMean
from adaptive_spec.kv.costs import LinkCosts, PrefillRate


@dataclass(frozen=True, slots=True)
class RemotePrefillPolicy:
    min_tokens: int = 2048  # fewer new tokens are always prefilled here: not worth a round trip
    margin: float = 0.25  # remote must be estimated this much faster (0.25: 25% less time)
    force: bool = False  # prefill remotely whenever possible, whatever the estimate (tests, benchmarks)
    # Priors, until measured:
    remote_prefill_tps: float = 2000.0
    bandwidth_bytes_per_s: float = 100e6  # ~1 Gbit/s
    round_trip_s: float = 0.05
    bytes_per_token: float = 120_000.0  # pessimistic: a 27B-class model with an f16 cache
    save_s_per_1k: float = 0.02
    restore_s_per_1k: float = 0.02
    prior_weight: float = 2.0
    half_life: float = 20.0  # in remote prefills


@dataclass(frozen=True, slots=True)
class RemoteMeasurement:
    """One remote prefill, as measured by the proxy (and the servers' own timings)."""

    tokens: int  # tokens the slot file holds
    prompt_n: int  # tokens the remote server prefilled (the rest it had cached)
    prefill_s: float  # the remote server's own prompt time
    round_trip_s: float  # the prefill call's wall time less the server's prompt and save times
    save_s: float
    file_bytes: int
    transfer_s: float
    restore_s: float


@dataclass(frozen=True, slots=True)
class RemotePrefillChoice:
    remote: bool
    local_s: float
    remote_s: float
    transfer_s: float
    reason: str


class RemoteCosts:
    """The learned terms of the remote path."""

    def __init__(self, policy: RemotePrefillPolicy) -> None:
        self.policy = policy
        forget = 0.5 ** (1.0 / policy.half_life)
        w = policy.prior_weight
        self._prefill, self._rtt = RunningMean(w, forget), RunningMean(w, forget)
        self._save, self._restore = RunningMean(w, forget), RunningMean(w, forget)
        self.link = LinkCosts(forget, policy.bytes_per_token, policy.bandwidth_bytes_per_s)  # kv/costs.py

    def observe_link(self, round_trip_s: float | None, bandwidth_bytes_per_s: float | None) -> None:
        """A probe of the link (at start-up): its round trip and a timed download."""
        if round_trip_s is not None and round_trip_s >= 0:
            self._rtt.add(round_trip_s)
        self.link.observe_link(bandwidth_bytes_per_s)

    def observe(self, m: RemoteMeasurement) -> None:
        if m.prompt_n >= 64 and m.prefill_s > 0:
            self._prefill.add(m.prefill_s / m.prompt_n)
        self._rtt.add(max(0.0, m.round_trip_s))
        if m.tokens > 0:
            self._save.add(m.save_s / m.tokens)
            self._restore.add(m.restore_s / m.tokens)
        self.link.observe_transfer(m.tokens, m.file_bytes, m.transfer_s)

    def s_per_token(self) -> float:
        return self._prefill.value(1.0 / self.policy.remote_prefill_tps)

    def remote_s(self, tokens: int) -> float:
        p = self.policy
        save = self._save.value(p.save_s_per_1k / 1000.0) * tokens
        restore = self._restore.value(p.restore_s_per_1k / 1000.0) * tokens
        return (
            self._rtt.value(p.round_trip_s)
            + tokens * self.s_per_token()
            + save
            + self.link.transfer_s(tokens)
            + restore
        )

    def describe(self) -> dict[str, float]:
        return {
            "remote_prefill_tps": round(1.0 / self.s_per_token(), 1),
            "bandwidth_mb_per_s": round(self.link.bandwidth_bytes_per_s() / 1e6, 2),
            "bytes_per_token": round(self.link.bytes_per_token(), 1),
            "round_trip_ms": round(self._rtt.value(self.policy.round_trip_s) * 1000.0, 1),
        }


def choose(new_tokens: int, prompt_tokens: int, local: PrefillRate, costs: RemoteCosts) -> RemotePrefillChoice:
    """Prefill `new_tokens` here (after the rest of `prompt_tokens`, cached), or all `prompt_tokens` remotely and bring
    the slot back? One line of reason."""
    p = costs.policy
    local_s = local.seconds(new_tokens, max(0, prompt_tokens - new_tokens))
    tokens = max(prompt_tokens, new_tokens)
    remote_s, transfer_s = costs.remote_s(tokens), costs.link.transfer_s(tokens)
    figures = f"local {local_s:,.1f} s vs remote {remote_s:,.1f} s (of which transfer {transfer_s:,.1f} s)"
    if new_tokens < p.min_tokens and not p.force:
        return RemotePrefillChoice(False, local_s, remote_s, transfer_s, f"prefill here: {new_tokens:,} new tokens")
    if p.force:
        return RemotePrefillChoice(True, local_s, remote_s, transfer_s, f"remote prefill (forced): {figures}")
    if remote_s * (1.0 + p.margin) < local_s:
        saves = local_s - remote_s
        reason = f"remote prefill of {tokens:,} tokens saves {saves:,.1f} s: {figures}"
        return RemotePrefillChoice(True, local_s, remote_s, transfer_s, reason)
    return RemotePrefillChoice(False, local_s, remote_s, transfer_s, f"prefill here ({new_tokens:,} tokens): {figures}")
