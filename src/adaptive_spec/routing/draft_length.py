"""The draft length (`speculative.n_max`) for a session on a model-drafter setting, from its measured acceptance.

A cap only shortens drafts the server would make. It pays where the drafter makes its tokens one at a time (a draft
model, EAGLE3, MTP heads): each drafted token costs a drafter step, and verifying a long draft the target rejects
early wastes both. DFlash computes its whole block at once, so a cap saves verification only, and ngram-mod
proposes nothing shorter than its `n_min`: neither is capped here.

With per-token acceptance `a` (drafts accepted up to the first rejection), a draft of `n` tokens yields
`E(n) = (1 - a^(n+1)) / (1 - a)` tokens per verification step at a cost of `1 + k·n` target steps, `k` being a
drafted token's cost relative to one (`estimator.draft_token_cost`). The cap is the `n` that maximizes
`E(n) / (1 + k·n)`. `a` comes from the session's measured acceptance `s` (accepted / drafted, llama-server's counts),
which for drafts of length `n` is `a·(1 - a^n) / ((1 - a)·n)`; it is inverted at the drafts' measured mean length
(drafted tokens over verification steps, a step being each output token not accepted from a draft: a drafter also
stops a draft early when it is unsure, `--spec-draft-p-min`). Pure.
"""

from __future__ import annotations

from collections.abc import Iterable

from adaptive_spec.llama.profiles import ProfileInfo
from adaptive_spec.policy.model import Policy
from adaptive_spec.routing.decision import DraftCap
from adaptive_spec.routing.placements import Placement

SEQUENTIAL_DRAFTERS = frozenset({"draft-simple", "draft-eagle3", "draft-mtp"})
# The longest draft the router chooses (a draft model's default --spec-draft-n-max is 16).
LONGEST_CAP = 16


def capped_profiles(infos: Iterable[ProfileInfo]) -> dict[str, int]:
    """The profiles whose draft length the router may cap per request: a sequential model drafter alone (no
    n-grams, whose drafts a cap below their n_min would end) on a server that takes `speculative.n_max`, each with
    the longest cap it may choose."""
    out = {}
    for info in infos:
        drafting = set(info.spec_types or ()) - {"none"}
        if info.per_request is not None and drafting and drafting <= SEQUENTIAL_DRAFTERS and info.per_request.n_max:
            out[info.name] = min(LONGEST_CAP, info.per_request.n_max)
    return out


def accepted_share(alpha: float, n: float) -> float:
    """The share of an `n`-token draft's tokens accepted, at per-token acceptance `alpha`."""
    if n <= 0:
        return 0.0
    if alpha >= 1.0:
        return 1.0
    kept: float = alpha * (1.0 - alpha**n) / ((1.0 - alpha) * n)
    return kept


def per_token_acceptance(share: float, n: float) -> float:
    """The per-token acceptance that gives `share` of `n`-token drafts accepted (bisection: the share rises with
    alpha)."""
    share = min(1.0, max(0.0, share))
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if accepted_share(mid, n) < share:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def tokens_per_cost(alpha: float, n: int, token_cost: float) -> float:
    """Tokens per target step of work for drafts of `n` tokens: E(n) / (1 + k·n)."""
    made = float(n + 1) if alpha >= 1.0 else (1.0 - alpha ** (n + 1)) / (1.0 - alpha)
    return made / (1.0 + token_cost * n)


def draft_cap(share: float, drafted_at: float, server_n_max: int, token_cost: float) -> int:
    """The draft length (1 .. `server_n_max`) that makes the most tokens per unit of work for a session whose
    drafts, `drafted_at` tokens long on average, had `share` of their tokens accepted."""
    alpha = per_token_acceptance(share, max(1.0, drafted_at))
    return max(range(1, max(1, server_n_max) + 1), key=lambda n: (tokens_per_cost(alpha, n, token_cost), -n))


def session_cap(longest: int | None, placement: Placement | None, policy: Policy) -> DraftCap | None:
    """The draft-length stage of a decision: the cap for a session on a profile the router may cap (`longest`, from
    `capped_profiles`), from the acceptance it measured there; None before it has one, or where the policy turns
    it off."""
    if not policy.route.adapt_draft_length or longest is None or placement is None:
        return None
    share = placement.drafter_acceptance
    if share is None:
        return None
    at = placement.drafted_per_step or float(longest)
    cap = draft_cap(share, at, longest, policy.estimator.draft_token_cost)
    alpha = per_token_acceptance(share, at)
    return DraftCap(
        cap, f"draft length {cap} (drafter accepted {share:.0%} of drafts {at:.1f} tokens long: per token {alpha:.2f})"
    )
