"""A decision composed from its stages (routing/decision.py): each figure read from the latest stage that has one,
the reason's parts in stage order."""

from __future__ import annotations

from adaptive_spec.routing.decision import Choice, DraftCap, MovePart, PromptPart, ReplicaPart, compose

CHOICE = Choice("iterative", "estimate", ("iterative: est 2.4x",), 0.7, 9000, moved_from="oneshot", handoff=True)


def test_a_choice_alone_reads_as_itself_on_the_one_replica() -> None:
    decision = compose(CHOICE)
    assert (decision.profile, decision.kind, decision.reason) == ("iterative", "estimate", "iterative: est 2.4x")
    assert (decision.handoff, decision.handoff_tokens, decision.moved_from) == (True, 0, "oneshot")
    assert (decision.replica, decision.replica_kind, decision.replica_moved_from) == (0, "only", None)
    assert decision.new_tokens is None and decision.n_max is None and not decision.side


def test_the_reason_is_the_stages_parts_in_order_and_a_stage_without_one_adds_nothing() -> None:
    decision = compose(
        CHOICE,
        PromptPart(new_tokens=400),
        DraftCap(6, "draft length 6"),
        ReplicaPart(1, "least-loaded", "iterative#1: least loaded"),
    ).after(MovePart("warm start: head restored", new_tokens=120))
    assert decision.reasons == (
        "iterative: est 2.4x",
        "draft length 6",
        "iterative#1: least loaded",
        "warm start: head restored",
    )
    assert decision.reason == "; ".join(decision.reasons)
    assert compose(CHOICE, placed=ReplicaPart(0, "only", "")).reasons == ("iterative: est 2.4x",)
    assert decision.n_max == 6 and decision.replica == 1
    # The profile stage's own parts (the load rule's, a move's cost) come first, each a part of its own.
    held = Choice("oneshot", "load", ("oneshot: est 1.0x", "iterative held back: load"), 0.1, 900)
    assert compose(held, draft=DraftCap(4, "draft length 4")).reason == (
        "oneshot: est 1.0x; iterative held back: load; draft length 4"
    )


def test_a_later_stage_figure_stands_over_an_earlier_ones() -> None:
    prompt = PromptPart(new_tokens=400, side=True)
    # A replica whose KV is out of reach: no handoff, and the whole prompt is prefilled.
    out_of_reach = compose(CHOICE, prompt, placed=ReplicaPart(1, "replaced", "", 0, False, 0, 9000))
    assert (out_of_reach.handoff, out_of_reach.handoff_tokens, out_of_reach.new_tokens) == (False, 0, 9000)
    assert out_of_reach.replica_moved_from == 0 and out_of_reach.side
    # A replica stage that leaves the handoff to the profile stage: the choice's figures stand.
    kept = compose(CHOICE, prompt, placed=ReplicaPart(2, "least-loaded", ""))
    assert (kept.handoff, kept.new_tokens) == (True, 400)
    # A move that says nothing of the tokens leaves the estimate; one that does, replaces it; the last one counts.
    noted = kept.after(MovePart("remote prefill: 3.1 s"))
    assert noted.new_tokens == 400 and noted.reason.endswith("; remote prefill: 3.1 s")
    assert noted.after(MovePart("head", 50)).after(MovePart("again")).new_tokens == 50
    assert kept.reasons == ("iterative: est 2.4x",)  # `after` gives a new decision; the first is unchanged
