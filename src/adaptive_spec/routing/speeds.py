"""Per-profile speeds learned online from llama-server's timings, starting from priors.

Decode time per output token is modelled from the session's copyability `x` (the share of output an n-gram drafter
would produce from context), its drafter acceptance `a` (the share of a model drafter's tokens the target accepts)
and the context length `k` (in thousands of tokens):

    profile without speculation:      seconds/token = b_p · (1 + c·k)
    n-gram profile:                   seconds/token = b · (1 + c·k) · (1 + o) · (1 − g_p·x)
    model-drafter profile:            seconds/token = b · (1 + c·k) · (d0 − d1·a)
    model drafter + n-gram:           seconds/token = b · (1 + c·k) · (d0 − d1·a) · (1 − g_p·x)

`b_p` is each plain profile's measured speed; `b` the reference: what the plain profiles measured (before they have
data, what the speculating profiles' measurements imply). `o` is the n-gram overhead on output it cannot copy, `c` the
slowdown with context (both priors from the policy), and `g_p` the n-gram gain, learned per profile by ridge
regression toward the prior `1 − 1/ngram_max_speedup`. The structure is the knowledge: an n-gram profile is never
faster than plain decoding on output it cannot copy, however little it has been measured, so one-shot prompts are
not sent to it on the strength of its edit-session numbers. A model drafter's line (one per drafter: the settings
that use it share it) is learned whole (intercept and
slope, ridge toward `1 + drafter_overhead` at acceptance 0 and `1/drafter_max_speedup` at 1): at acceptance 0 it
costs its drafting and verification (llama.cpp #23052: prose at 0.68-0.91×), and how much acceptance buys depends on
the hardware (3.7× for DFlash on a GPU; a loss at 97% acceptance for a 0.5B drafting for a 1.5B on 2 CPU cores). Each
request's own acceptance, from llama-server's counts, is the point it adds. On a server with a model drafter, the
setting without speculation still pays for keeping the drafter's cache in step: it is measured there as its own `b_p`.
Prefill is one line for all profiles (they serve the same model): a prompt token at position p costs a + b·p seconds
(attention reads every token before it), so N new tokens after C cached ones cost a·N + b·N·(C + (N−1)/2), fitted from
llama-server's own (cache_n, prompt_n, prompt_ms) by ridge regression toward the prior (a from `prefill_tps`, b = a ×
`prefill_slowdown_per_1k`). A measurement at start (`calibrate`) replaces the priors of a and of the plain decode
speed, and the model's state is kept across runs (`snapshot`, `restore`); `basis()` says whether a figure is still the
prior's (`routing/prefill_line.py`). Slot save/restore cost and prompt bytes per token are running averages with
priors. A KV handoff between hosts also pays the slot file's transfer, priced by `kv/costs.py` (`self.link`). Old
measurements fade (half-life in requests).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from adaptive_spec.common.means import RunningMean
from adaptive_spec.kv.costs import LinkCosts, PrefillRate
from adaptive_spec.policy.model import EstimatorPolicy, HandoffPolicy
from adaptive_spec.routing.prefill_line import PrefillLine
from adaptive_spec.telemetry.records import Timings

# Shorter responses measure per-request overheads, not decode speed. An n-gram profile learns its gain from the same
# answers: its drafts may run past an answer's end (a 37-token tool call drafted 64 tokens at a time, measured), so a
# short answer is drafted too, and on a CPU the tokens verified past its end cost more than the accepted ones save.
_MIN_DECODE_TOKENS = 32
_MIN_PREFILL_TOKENS = 64
_MAX_GAIN = 0.95
_MAX_FACTOR = 20.0  # a drafter's predicted speed stays within 1/20 .. 20 times the reference
MIN_DRAFTED = 8  # fewer drafted tokens say little of a drafter's acceptance


def is_ngram(spec_types: tuple[str, ...] | None) -> bool:
    """Whether a profile drafts from n-grams of its context (ngram-mod, ngram-map-*, ngram-simple, ...)."""
    return bool(spec_types) and any(t.startswith("ngram") for t in spec_types or ())


def drafted_per_step(timings: Timings) -> float | None:
    """The model drafter's mean draft length per verification step in one response: every output token not accepted
    from a draft ends a step, so steps = predicted − accepted (all drafters' accepted tokens), and the drafter's
    drafted tokens over them; None when it drafted nothing."""
    drafted = timings.drafter_n or timings.draft_n
    steps = timings.predicted_n - timings.draft_n_accepted
    return drafted / steps if drafted > 0 and steps > 0 else None


def has_drafter(spec_types: tuple[str, ...] | None) -> bool:
    """Whether a profile drafts with a model (draft-dflash, draft-simple, draft-mtp, draft-eagle3, ...)."""
    return any(t.startswith("draft") for t in spec_types or ())


def drafter_acceptance(timings: Timings, spec_types_drafter_only: bool, min_drafted: int = 1) -> float | None:
    """The share of the model drafter's tokens the target accepted in one response, from llama-server's counts:
    the drafter's own (`draft_by_type`) where the server splits them, else all drafts when the drafter was the only
    type that could draft; None when it drafted nothing (or the counts cannot be told apart)."""
    if timings.drafter_n > 0:
        return timings.drafter_n_accepted / timings.drafter_n if timings.drafter_n >= min_drafted else None
    if spec_types_drafter_only and timings.draft_n >= max(1, min_drafted):
        return timings.draft_n_accepted / timings.draft_n
    return None


@dataclass(frozen=True, slots=True)
class ProfileSpeeds:
    """What the model believes of one profile, for display."""

    profile: str
    ngram: bool
    drafter: bool
    measured: float  # measured requests, after forgetting
    decode_tps_plain_text: float  # at copyability 0 and drafter acceptance 0.3, 4,000 tokens of context
    decode_tps_copyable: float  # at copyability 0.8 and drafter acceptance 0.8, 4,000 tokens of context
    prefill_tps: float


class _Gain:
    """Ridge regression of (1 − r) on x through the origin, r = measured / predicted-without-gain."""

    __slots__ = ("n", "sxr", "sxx")

    def __init__(self) -> None:
        self.sxr = 0.0
        self.sxx = 0.0
        self.n = 0.0

    def add(self, x: float, r: float, forget: float) -> None:
        self.sxr = self.sxr * forget + x * (1.0 - r)
        self.sxx = self.sxx * forget + x * x
        self.n = self.n * forget + 1.0

    def value(self, prior: float, weight: float) -> float:
        return min(_MAX_GAIN, max(0.0, (self.sxr + weight * prior) / (self.sxx + weight)))


class _Line:
    """Ridge regression of r on a with an intercept, r = c + m·a, toward a prior line (c0, m0): a model drafter's
    speed relative to the reference at acceptance a."""

    __slots__ = ("n", "s1", "sa", "saa", "sar", "sr")

    def __init__(self) -> None:
        self.s1 = self.sa = self.saa = self.sr = self.sar = self.n = 0.0

    def add(self, a: float, r: float, forget: float) -> None:
        self.s1 = self.s1 * forget + 1.0
        self.sa = self.sa * forget + a
        self.saa = self.saa * forget + a * a
        self.sr = self.sr * forget + r
        self.sar = self.sar * forget + a * r
        self.n = self.n * forget + 1.0

    def value(self, c0: float, m0: float, weight: float, a: float) -> float:
        # Normal equations of Σ(r − c − m·a)² + weight·((c − c0)² + (m − m0)²).
        p, q, t = self.s1 + weight, self.sa, self.saa + weight
        u, v = self.sr + weight * c0, self.sar + weight * m0
        det = p * t - q * q
        c, m = (u * t - q * v) / det, (p * v - q * u) / det
        return min(_MAX_FACTOR, max(1.0 / _MAX_FACTOR, c + m * a))


Basis = Literal["prior", "measured"]
SNAPSHOT_VERSION = 1


class SpeedModel:
    def __init__(
        self,
        estimator: EstimatorPolicy,
        handoff: HandoffPolicy,
        kinds: Mapping[str, tuple[str, ...] | None],
    ) -> None:
        self.estimator, self.handoff = estimator, handoff
        self.forget = 0.5 ** (1.0 / estimator.half_life)
        self._ngram: dict[str, bool] = {}
        self._drafter: dict[str, bool] = {}
        self._own: dict[str, RunningMean] = {}  # plain profiles: seconds/token at no context
        self._gain: dict[str, _Gain] = {}  # n-gram profiles (and a drafter + n-gram profile's n-gram part)
        # Model drafters, by their types: the settings of one server that share its drafter (the drafter alone, the
        # drafter + n-gram) share what it was measured to do.
        self._line: dict[tuple[str, ...], _Line] = {}
        self._drafter_key: dict[str, tuple[str, ...]] = {}
        # Prefill is one line for all profiles: they serve the same model (the proxy refuses otherwise), and two
        # servers' noise must not make one look faster at reading prompts.
        self._prefill = PrefillLine()
        # Measured at start (`calibrate`, or kept from an earlier run): they stand in for the policy's priors.
        self._measured_prefill_s: float | None = None  # seconds per prompt token at position 0
        self._measured_decode_s: float | None = None  # plain decoding's seconds per token at no context
        for name, types in kinds.items():
            self.set_kind(name, types)
        self._implied_ref = RunningMean(estimator.prior_weight, self.forget)  # what n-gram measurements imply
        self._bytes_per_token = RunningMean(estimator.prior_weight, self.forget)
        self._save_s_per_token = RunningMean(2.0, self.forget)
        self._restore_s = RunningMean(2.0, self.forget)
        self.link = LinkCosts(self.forget)  # a handoff between hosts: the relays' link (kv/costs.py)

    def set_policy(self, estimator: EstimatorPolicy, handoff: HandoffPolicy) -> None:
        """A reloaded policy changes the priors, their weight and the half-life; what was measured stays."""
        self.estimator, self.handoff = estimator, handoff
        self.forget = 0.5 ** (1.0 / estimator.half_life)
        for avg in (*self._own.values(), self._implied_ref, self._bytes_per_token):
            avg.weight, avg.forget = estimator.prior_weight, self.forget
        for avg in (self._save_s_per_token, self._restore_s):
            avg.forget = self.forget
        self.link.set_forget(self.forget)

    def set_kind(self, profile: str, spec_types: tuple[str, ...] | None) -> None:
        """A profile's spec types (an attached profile's become known after its first request, from /slots)."""
        self._ngram[profile] = is_ngram(spec_types)
        self._drafter[profile] = has_drafter(spec_types)
        self._own.setdefault(profile, RunningMean(self.estimator.prior_weight, self.forget))
        self._gain.setdefault(profile, _Gain())
        key = tuple(t for t in spec_types or () if t.startswith("draft"))
        self._drafter_key[profile] = key
        self._line.setdefault(key, _Line())

    def is_ngram(self, profile: str) -> bool:
        return self._ngram.get(profile, False)

    def has_drafter(self, profile: str) -> bool:
        return self._drafter.get(profile, False)

    def speculates(self, profile: str) -> bool:
        return self.is_ngram(profile) or self.has_drafter(profile)

    # --- the model --------------------------------------------------------------------------------------------

    def _context_factor(self, context_tokens: float) -> float:
        return 1.0 + self.estimator.context_slowdown_per_1k * max(0.0, context_tokens) / 1000.0

    def _decode_prior(self) -> float:
        """Plain decoding's seconds per token at no context before any request is measured: the start-up
        measurement's, else the policy's prior."""
        measured = self._measured_decode_s
        return measured if measured is not None else 1.0 / self.estimator.decode_tps

    def reference_s_per_token(self) -> float:
        """Decoding without n-gram drafting at no context: the plain profiles' measurements, else what the
        n-gram profiles' measurements imply, else the prior."""
        prior = self._implied_ref.value(self._decode_prior())
        measured = [a for name, a in self._own.items() if a.n > 0.5 and not self.speculates(name)]
        if not measured:
            return prior
        return sum(a.value(prior) * a.n for a in measured) / sum(a.n for a in measured)

    def gain(self, profile: str) -> float:
        prior = 1.0 - 1.0 / self.estimator.ngram_max_speedup
        g = self._gain.get(profile)
        return g.value(prior, self.estimator.prior_weight) if g is not None else prior

    def _ngram_shape(self, profile: str, x: float) -> float:
        if self.has_drafter(profile):  # the drafter's line holds the overhead
            return 1.0 - self.gain(profile) * x
        return (1.0 + self.estimator.ngram_overhead) * (1.0 - self.gain(profile) * x)

    def drafter_factor(self, profile: str, acceptance: float) -> float:
        """A model-drafter profile's seconds/token over the reference's at this acceptance (below 1: faster)."""
        e = self.estimator
        c0 = 1.0 + e.drafter_overhead
        m0 = 1.0 / e.drafter_max_speedup - c0
        line = self._line.get(self._drafter_key.get(profile, ()))
        a = min(1.0, max(0.0, acceptance))
        return line.value(c0, m0, e.prior_weight, a) if line is not None else c0 + m0 * a

    def _shape(self, profile: str, x: float, a: float) -> float:
        shape = self.drafter_factor(profile, a) if self.has_drafter(profile) else 1.0
        return shape * self._ngram_shape(profile, x) if self.is_ngram(profile) else shape

    def decode_s_per_token(
        self, profile: str, copy_share: float, context_tokens: float, acceptance: float = 0.0
    ) -> float:
        """`acceptance`: the share of a model drafter's tokens the session's output is expected to have accepted
        (used by model-drafter profiles only)."""
        ctx = self._context_factor(context_tokens)
        if self.speculates(profile):
            return self.reference_s_per_token() * ctx * self._shape(profile, copy_share, acceptance)
        own = self._own.get(profile)
        if own is not None and own.n > 0.5:
            return own.value(self._implied_ref.value(self._decode_prior())) * ctx
        return self.reference_s_per_token() * ctx

    def plain_s_per_token(self, context_tokens: float) -> float:
        """Decoding without n-gram drafting: the yardstick the decisions' `×` figures are quoted against."""
        return self.reference_s_per_token() * self._context_factor(context_tokens)

    def prefill_rate(self) -> PrefillRate:
        """The prefill line now: a prompt token at position p prefills in a + b·p/1000 seconds."""
        e = self.estimator
        measured = self._measured_prefill_s
        a0 = measured if measured is not None else 1.0 / e.prefill_tps
        return self._prefill.solve(a0, e.prefill_slowdown_per_1k, e.prior_weight)

    def prefill_s(self, profile: str, tokens: float, cached: float = 0.0) -> float:
        """Prefilling `tokens` new prompt tokens after `cached` ones the slot holds."""
        return self.prefill_rate().seconds(tokens, cached)

    def basis(self) -> Basis:
        """Whether the prefill figures come from measurements (at start, kept from an earlier run, or of requests
        served) or still from the policy's prior alone."""
        return "measured" if self._measured_prefill_s is not None or self._prefill.n > 0.5 else "prior"

    def handoff_s(self, tokens: float, across_hosts: bool = False) -> float:
        """Slot save + restore; `across_hosts`: plus the slot file's transfer (`transfer_s`)."""
        save = self._save_s_per_token.value(self.handoff.save_s_per_1k / 1000.0) * tokens
        moved = self.link.transfer_s(tokens) if across_hosts else 0.0
        return save + moved + self._restore_s.value(self.handoff.restore_s)

    def prompt_tokens(self, body_bytes: int) -> int:
        return int(body_bytes / self._bytes_per_token.value(self.estimator.chars_per_token))

    # --- learning ---------------------------------------------------------------------------------------------

    def observe(self, profile: str, copy_share: float, timings: Timings, body_bytes: int) -> None:
        """Fold in one finished request's timings (measured by llama-server)."""
        if timings.from_usage:
            return
        context = timings.prompt_n + timings.cache_n
        if context > 0 and body_bytes > 0:
            self._bytes_per_token.add(body_bytes / context)
        if timings.prompt_n >= _MIN_PREFILL_TOKENS and timings.prompt_ms > 0:
            self._prefill.add(timings.cache_n, timings.prompt_n, timings.prompt_ms / 1000.0, self.forget)
        if timings.predicted_n < _MIN_DECODE_TOKENS or timings.predicted_ms <= 0:
            return
        y = timings.predicted_ms / 1000.0 / timings.predicted_n
        at_no_context = y / self._context_factor(context + timings.predicted_n / 2)
        if not self.speculates(profile):
            self._own.setdefault(profile, RunningMean(self.estimator.prior_weight, self.forget)).add(at_no_context)
            return
        x = min(1.0, max(0.0, copy_share))
        if self.has_drafter(profile):
            self._observe_drafter(profile, x, timings, at_no_context)
            return
        r = at_no_context / ((1.0 + self.estimator.ngram_overhead) * self.reference_s_per_token())
        self._gain.setdefault(profile, _Gain()).add(x, r, self.forget)
        self._implied_ref.add(at_no_context / self._ngram_shape(profile, x))

    def _observe_drafter(self, profile: str, x: float, timings: Timings, at_no_context: float) -> None:
        """A model-drafter profile's point: this response's own acceptance (llama-server's counts) against its speed
        over the reference; with n-gram drafting too, the drafter's line and the n-gram gain each learn from what
        the other one predicts (backfitting, one step per response)."""
        ngram = self.is_ngram(profile)
        a = drafter_acceptance(timings, spec_types_drafter_only=not ngram, min_drafted=MIN_DRAFTED)
        if a is None:
            return
        r = at_no_context / self.reference_s_per_token()
        ngram_part = self._ngram_shape(profile, x) if ngram else 1.0
        self._line.setdefault(self._drafter_key.get(profile, ()), _Line()).add(a, r / ngram_part, self.forget)
        if ngram:
            self._gain.setdefault(profile, _Gain()).add(x, r / self.drafter_factor(profile, a), self.forget)
        self._implied_ref.add(at_no_context / self._shape(profile, x, a))

    def calibrate(self, timings: Timings, plain: bool) -> bool:
        """A server's speeds measured at start on a fixed prompt (the proxy's own request): its prefill, brought to
        position 0 along the prior's slope, replaces the prior `prefill_tps`; with `plain` (sent without
        speculation) its decode, brought to no context, replaces `decode_tps`. False: too short to say."""
        if timings.from_usage or timings.prompt_n < _MIN_PREFILL_TOKENS or timings.prompt_ms <= 0:
            return False
        m = PrefillLine.mean_position_k(timings.cache_n, timings.prompt_n)
        y = timings.prompt_ms / 1000.0 / timings.prompt_n
        self._measured_prefill_s = y / (1.0 + self.estimator.prefill_slowdown_per_1k * m)
        if plain and timings.predicted_n >= _MIN_DECODE_TOKENS and timings.predicted_ms > 0:
            context = timings.prompt_n + timings.cache_n + timings.predicted_n / 2
            per_token = timings.predicted_ms / 1000.0 / timings.predicted_n
            self._measured_decode_s = per_token / self._context_factor(context)
        return True

    def snapshot(self) -> dict[str, Any]:
        """What was measured, as JSON, to be kept under the servers' identity and `restore`d at the next start."""

        def mean(avg: RunningMean) -> list[float]:
            return [avg.total, avg.n]

        return {
            "version": SNAPSHOT_VERSION,
            "measured_prefill_s": self._measured_prefill_s,
            "measured_decode_s": self._measured_decode_s,
            "prefill": self._prefill.state(),
            "own": {name: mean(avg) for name, avg in self._own.items()},
            "implied_ref": mean(self._implied_ref),
            "bytes_per_token": mean(self._bytes_per_token),
            "gain": {name: [g.sxr, g.sxx, g.n] for name, g in self._gain.items()},
            "line": {",".join(key): [ln.s1, ln.sa, ln.saa, ln.sr, ln.sar, ln.n] for key, ln in self._line.items()},
        }

    def restore(self, data: Mapping[str, Any]) -> bool:
        """A `snapshot` from an earlier run; profiles not served now are left out. False (nothing changed): not a
        snapshot of this version."""
        if data.get("version") != SNAPSHOT_VERSION:
            return False
        try:
            self._restore(data)
        except (KeyError, TypeError, ValueError):
            return False
        return True

    def _restore(self, data: Mapping[str, Any]) -> None:
        def load(avg: RunningMean, values: list[float]) -> None:
            avg.total, avg.n = float(values[0]), float(values[1])

        prefill, decode = data.get("measured_prefill_s"), data.get("measured_decode_s")
        self._prefill.load(list(data["prefill"]))
        self._measured_prefill_s = float(prefill) if prefill is not None else None
        self._measured_decode_s = float(decode) if decode is not None else None
        for name, values in data.get("own", {}).items():
            if name in self._own:
                load(self._own[name], values)
        load(self._implied_ref, data["implied_ref"])
        load(self._bytes_per_token, data["bytes_per_token"])
        for name, (sxr, sxx, n) in data.get("gain", {}).items():
            if name in self._gain:
                gain = self._gain[name]
                gain.sxr, gain.sxx, gain.n = float(sxr), float(sxx), float(n)
        for joined, values in data.get("line", {}).items():
            line = self._line.get(tuple(t for t in joined.split(",") if t))
            if line is not None:
                line.s1, line.sa, line.saa, line.sr, line.sar, line.n = (float(v) for v in values)

    def observe_handoff(self, tokens: int, save_s: float, restore_s: float) -> None:
        if tokens > 0:
            self._save_s_per_token.add(save_s / tokens)
        self._restore_s.add(restore_s)

    def describe(self) -> list[ProfileSpeeds]:
        out = []
        for name in self._ngram:
            if self.has_drafter(name):
                measured = self._line[self._drafter_key[name]].n
            else:
                measured = self._gain[name].n if self.is_ngram(name) else self._own[name].n
            out.append(
                ProfileSpeeds(
                    profile=name,
                    ngram=self.is_ngram(name),
                    drafter=self.has_drafter(name),
                    measured=round(measured, 2),
                    decode_tps_plain_text=round(1.0 / self.decode_s_per_token(name, 0.0, 4000, 0.3), 2),
                    decode_tps_copyable=round(1.0 / self.decode_s_per_token(name, 0.8, 4000, 0.8), 2),
                    prefill_tps=round(1.0 / max(1e-9, self.prefill_s(name, 1.0)), 1),
                )
            )
        return out
