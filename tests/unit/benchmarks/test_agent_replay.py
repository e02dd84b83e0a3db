"""The agent replay's summary: the router's estimates against the acceptance measured on the n-gram arm, then and
now, and whether each choice was the faster profile."""

from __future__ import annotations

from typing import Any

from benchmarks.agents.replay import recorded_turns, summarize


def _arm(profile: str, est: float | None, tok: int, ms: float, accepted: int = 0) -> dict[str, Any]:
    return {
        "profile": profile,
        "route": "estimate",
        "est_copyable": est,
        "predicted_n": tok,
        "predicted_ms": ms,
        "prompt_n": 10,
        "draft_n": 64 if accepted else 0,
        "draft_n_accepted": accepted,
    }


def test_the_summary_pairs_each_turns_estimates_with_the_measured_acceptance() -> None:
    turns = []
    for est_then, est_now, accepted in ((0.0, 0.1, 0), (0.0, 0.5, 20), (0.0, 0.9, 36)):
        fast_ngram = accepted > 10
        turns.append(
            {
                "est_copyable": est_then,
                "profile": "oneshot",
                "arms": {
                    "oneshot": _arm("oneshot", None, 40, 1000.0),
                    "iterative": _arm("iterative", None, 40, 500.0 if fast_ngram else 1100.0, accepted),
                    "routed": _arm("iterative" if est_now > 0.3 else "oneshot", est_now, 40, 600.0),
                },
            }
        )
    summary = summarize(turns, "iterative")
    assert summary["router_chose_fastest"] == {
        "recorded": "1/3 (within 5% of the fastest)",  # oneshot each time: right only where nothing was copied
        "replayed": "3/3 (within 5% of the fastest)",
    }
    now = summary["est_vs_measured"]["replayed"]
    assert now["pairs"] == 3 and now["correlation"] > 0.99 and now["median_abs_error"] == 0.0
    assert summary["est_vs_measured"]["recorded"]["correlation"] is None  # a constant estimate correlates with nothing
    assert round(summary["tok_s"]["oneshot"], 1) == 40.0


def test_only_generating_turns_with_bodies_are_replayed_with_their_estimates() -> None:
    lines: list[dict[str, Any]] = [
        {"kind": "profiles"},
        {"kind": "request", "api": "chat", "request_body": {"messages": []}, "reason": "x: copyable 37% (last turn)"},
        {"kind": "request", "api": "chat", "request_body": {"messages": []}, "side": True},
        {"kind": "request", "api": "models", "request_body": {}},
        {"kind": "request", "api": "chat", "request_body": None},
    ]
    turns = recorded_turns(lines)
    assert len(turns) == 1 and turns[0]["est_copyable"] == 0.37
