from __future__ import annotations

import random
from typing import Any

from adaptive_spec.sessions.ngram_replay import SEPARATOR, NgramIndex, NgramParams, estimate_drafts
from adaptive_spec.sessions.statistics import ContextTracker, closing, opening

PARAMS = NgramParams(n_match=4, n_min=3, n_max=8)


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_copying_the_context_is_drafted_and_accepted() -> None:
    context = _tokens(1, 400)
    index = NgramIndex(PARAMS.n_match, 10_000)
    index.extend(context)
    index.extend(context[96:100])  # the model is about to repeat context[100:]
    estimate = estimate_drafts(index, context[100:300], PARAMS)
    assert estimate.output_tokens == 200
    assert estimate.accepted_share > 0.8
    assert estimate.acceptance > 0.8
    assert estimate.mean_accepted_run >= 5


def test_novel_output_is_never_drafted() -> None:
    index = NgramIndex(PARAMS.n_match, 10_000)
    index.extend(_tokens(1, 400))
    estimate = estimate_drafts(index, _tokens(2, 200), PARAMS)
    assert (estimate.drafted, estimate.accepted, estimate.accepted_share) == (0, 0, 0.0)


def test_drafts_shorter_than_n_min_are_dropped() -> None:
    index = NgramIndex(4, 1000)
    index.extend([1, 2, 3, 4, 5, 6, SEPARATOR, 1, 2, 3, 4])  # only "5, 6" can follow, then the chain ends
    assert index.draft(index.window, n_max=8, n_min=3) == []
    assert index.draft(index.window, n_max=8, n_min=2) == [5, 6]


def test_separator_stops_ngrams_spanning_messages() -> None:
    index = NgramIndex(2, 1000)
    assert index.extend([7, 8, SEPARATOR, 9]) == 0
    index.extend([SEPARATOR, 7, 8])
    assert index.draft(index.window, n_max=4, n_min=1) == []


def test_prompt_repeat_count() -> None:
    index = NgramIndex(3, 1000)
    block = [10, 11, 12, 13, 14, 15, 16]
    assert index.extend(block) == 0
    assert index.extend(block) == 4  # after the first 3 tokens re-establish the context, 13..16 are predicted


def test_index_stays_bounded() -> None:
    index = NgramIndex(4, 1000)
    index.extend(_tokens(3, 5000))
    assert len(index) <= 1000
    assert index.memory_bytes() < 1000 * 200


def test_tracker_turns_ewma_and_new_messages_only() -> None:
    tracker = ContextTracker(PARAMS, ewma_alpha=0.5)
    file_tokens = _tokens(5, 300)
    first_turn = [(b"sys", False), (b"u1", False)]
    assert tracker.pick("s", first_turn) == [0, 1]
    tracker.on_prompt("s", "p", [b"sys", b"u1"], [_tokens(4, 50), file_tokens], now=0.0)
    first = tracker.on_output("s", "p", b"r1", file_tokens[:250], now=1.0)
    assert first.turn == 1 and first.new_prompt_tokens == 350
    # Turn 2 appends the served reply and one user message: only the user message is new.
    second_turn = [(b"sys", False), (b"u1", False), (b"r1", True), (b"u2", False)]
    assert tracker.pick("s", second_turn) == [3]
    new_tokens, _ = tracker.on_prompt("s", "p", [b"sys", b"u1", b"r1", b"u2"], [[1, 2, 3]], 2.0)
    assert new_tokens == 3
    # A rewritten history (turn 1 summarised away) costs only the messages never seen.
    assert tracker.pick("s", [(b"sys", False), (b"summary", False), (b"r1", True), (b"u2", False)]) == [1]
    second = tracker.on_output("s", "p", b"r2", _tokens(6, 100), now=3.0)
    snap = tracker.snapshot("s")
    assert snap is not None and snap.turns == 2
    assert snap.est_accepted_share_ewma == 0.5 * second.est_accepted_share + 0.5 * first.est_accepted_share
    assert first.est_accepted_share > 0.5 > second.est_accepted_share


def test_tracker_bounds_sessions_and_expires_idle_ones() -> None:
    tracker = ContextTracker(PARAMS, max_sessions=2, idle_expiry_s=10)
    for i, sid in enumerate(("a", "b", "c")):
        tracker.on_prompt(sid, "p", [sid.encode()], [[1, 2, 3]], now=float(i))
    assert [s.session_id for s in tracker.snapshots()] == ["c", "b"]
    assert tracker.expire(now=11.5) == ["b"]
    assert [s.session_id for s in tracker.snapshots()] == ["c"]


def test_side_requests_are_recorded_but_not_turns_and_move_no_average() -> None:
    tracker = ContextTracker(PARAMS, ewma_alpha=0.5)
    text = list(range(100, 160))
    tracker.on_prompt("s", "p", [b"m1"], [text], 0.0)
    tracker.on_output("s", "p", b"r1", text, 0.0)  # copies its context: share near 1
    turns, share = tracker.copy_state("s")
    assert turns == 1 and share is not None and share > 0.5
    tracker.on_prompt("s", "p", [b"t"], [[7, 8, 9]], 0.0)
    side = tracker.on_output("s", "p", b"r2", [900, 901, 902, 903], 0.0, side=True)  # a title: nothing to copy
    assert side.side and tracker.copy_state("s") == (1, share)
    snap = tracker.snapshot("s")
    assert snap is not None and [t.side for t in snap.last_turns] == [False, True]


def test_a_main_line_that_starts_late_demotes_what_came_before() -> None:
    tracker = ContextTracker(PARAMS)
    tracker.on_prompt("s", "p", [b"t"], [[1, 2, 3]], 0.0)
    tracker.on_output("s", "p", b"r", [4, 5], 0.0)  # a title request, before the first real turn
    tracker.demote("s")
    assert tracker.copy_state("s") == (0, None)
    snap = tracker.snapshot("s")
    assert snap is not None and all(t.side for t in snap.last_turns)


def test_the_replay_and_the_index_agree_with_the_first_implementation_token_for_token() -> None:
    """The drafter runs one local loop per token (a method call per token was most of a statistics update): on
    random sessions — messages that copy earlier spans, separators, answers that repeat the context, tables trimmed
    as they fill — every count, every draft estimate and the table itself equal the first implementation's."""
    import random

    from tests.support.drafter_reference import RefNgramIndex, ref_estimate_drafts

    seen_drafts = seen_accepted = 0
    for seed in range(40):
        rng = random.Random(seed)
        params = rng.choice([NgramParams(), NgramParams(n_match=3, n_min=2, n_max=6), NgramParams(4, 1, 12)])
        max_tokens = rng.choice([64, 500, 100_000])
        fast, ref = NgramIndex(params.n_match, max_tokens), RefNgramIndex(params.n_match, max_tokens)
        history: list[int] = [rng.randrange(50) for _ in range(30)]
        for _ in range(rng.randint(1, 8)):
            prompt = [rng.randrange(50) for _ in range(rng.randint(0, 80))]
            if history and rng.random() < 0.7:  # a message that quotes an earlier span
                start = rng.randrange(len(history))
                prompt += history[start : start + rng.randint(5, 120)]
            assert fast.extend(prompt) == ref.extend(prompt)
            assert fast.extend((SEPARATOR,)) == ref.extend((SEPARATOR,))
            answer = history[-rng.randint(0, 100) :] + [rng.randrange(50) for _ in range(rng.randint(0, 60))]
            if rng.random() < 0.2:
                rng.shuffle(answer)
            estimate = estimate_drafts(fast, answer, params)
            assert estimate == ref_estimate_drafts(ref, answer, params), seed
            seen_drafts += estimate.drafts
            seen_accepted += estimate.accepted
            assert fast.extend((SEPARATOR,)) == ref.extend((SEPARATOR,))
            history += prompt + answer
            assert fast._table == ref._table and fast._recent == ref._recent and fast.indexed == ref.indexed
            assert (fast.window.hash, fast.window.run, fast.window.tokens) == (
                ref.window.hash,
                ref.window.run,
                ref.window.tokens,
            )
    assert seen_drafts > 50 and seen_accepted > 500  # the replays drafted, and drafts were accepted


def test_an_agents_short_call_and_result_cycle_is_drafted_across_the_framing() -> None:
    """A tool call (25 tokens) and its result (15) repeated turn after turn, with llama-server's own settings
    (24-token window, 48-token minimum draft): each message is shorter than a draft, the cycle in its framing is not,
    and the repeated calls are drafted whole. Separated by nothing but a reset, nothing would be."""
    tracker = ContextTracker(NgramParams())
    call, result = _tokens(7, 25), _tokens(8, 15)
    tracker.on_prompt("s", "p", [b"sys", b"u"], [_tokens(5, 300), _tokens(6, 20)], 0.0, ["system", "user"])
    digests = [b"sys", b"u"]
    turns = []
    for n in range(6):
        turns.append(tracker.on_output("s", "p", b"c%d" % n, call, 0.0, calls=True))
        digests += [b"c%d" % n, b"r%d" % n]
        tracker.on_prompt("s", "p", digests, [result], 0.0, ["tool"])
    assert turns[0].est_accepted == 0  # the first call is new
    assert all(t.est_accepted_share == 1.0 for t in turns[3:]), turns
    index = NgramIndex(24, 10_000)  # the same stream with each message on its own: no draft reaches 48 tokens
    index.extend(_tokens(5, 300))
    for _ in range(6):
        assert estimate_drafts(index, call, NgramParams()).drafted == 0
        index.extend([SEPARATOR, *result, SEPARATOR])


def test_a_rewritten_history_does_not_run_on_from_the_last_reply() -> None:
    tracker = ContextTracker(PARAMS)
    tracker.on_prompt("s", "p", [b"a"], [[1, 2, 3, 4, 5, 6]], 0.0)
    tracker.on_output("s", "p", b"r", [7, 8, 9], 0.0)
    session = tracker._sessions.get("s")
    assert session is not None
    tracker.on_prompt("s", "p", [b"a", b"r", b"u"], [[10]], 0.0)  # appended: the window runs on
    assert session.index.window.run > 4
    tracker.on_prompt("s", "p", [b"other"], [[11, 12]], 0.0)  # rewritten: a fresh window
    assert session.index.window.run == len(opening("user")) + 2 + len(closing("user"))


def _first_turn(tracker: ContextTracker, sid: str, digests: list[bytes], texts: list[list[int]]) -> tuple[Any, ...]:
    """A new session's first request and its reply: (pick, prompt figures, turn, indexed tokens)."""
    pick = tracker.pick(sid, [(d, False) for d in digests])
    roles = ["system", *(["user", "tool"] * len(texts))][: len(texts)]
    prompt = tracker.on_prompt(sid, "p", digests, [texts[i] for i in pick], 0.0, [roles[i] for i in pick])
    turn = tracker.on_output(sid, "p", b"reply-" + sid.encode(), texts[-1][:300], 1.0)
    snap = tracker.snapshot(sid)
    assert snap is not None
    return pick, prompt, turn, snap.indexed_tokens


def test_a_long_history_sent_again_as_a_new_session_is_indexed_once_with_the_same_figures() -> None:
    texts = [_tokens(20 + i, 1500) for i in range(4)]  # 6,000 tokens: kept as an opening
    digests = [b"sys", b"u1", b"t1", b"u2"]
    tracker = ContextTracker(PARAMS)
    plan_a, prompt_a, turn_a, indexed_a = _first_turn(tracker, "a", digests, texts)
    assert plan_a == [0, 1, 2, 3]
    # Another new session with the same history (no session id, sent again): nothing to tokenize or index.
    plan_b, prompt_b, turn_b, indexed_b = _first_turn(tracker, "b", digests, texts)
    assert plan_b == []
    assert (prompt_b, turn_b, indexed_b) == (prompt_a, turn_a, indexed_a)
    # One that goes on from it indexes only what follows, with the figures of indexing it all.
    more, more_digests = [*texts, _tokens(30, 200)], [*digests, b"u3"]
    plan_c, prompt_c, turn_c, indexed_c = _first_turn(tracker, "c", more_digests, more)
    assert plan_c == [4]
    alone = ContextTracker(PARAMS, opening_tokens=0)
    plan_d, prompt_d, turn_d, indexed_d = _first_turn(alone, "c", more_digests, more)
    assert plan_d == [0, 1, 2, 3, 4]
    assert (prompt_c, turn_c, indexed_c) == (prompt_d, turn_d, indexed_d)
    # The sessions are apart: a's next turn does not change what b and c started from.
    next_turn = [*[(d, False) for d in digests], (b"reply-a", True), (b"u9", False)]
    assert tracker.pick("a", next_turn) == [5]
    tracker.on_prompt("a", "p", [*digests, b"reply-a", b"u9"], [_tokens(40, 3000)], 2.0)
    plan_e, prompt_e, turn_e, indexed_e = _first_turn(tracker, "e", digests, texts)
    assert plan_e == [] and (prompt_e, turn_e, indexed_e) == (prompt_a, turn_a, indexed_a)


def test_openings_are_only_long_first_prompts_and_stay_bounded() -> None:
    tracker = ContextTracker(PARAMS, opening_tokens=10_000)
    short = [_tokens(50, 100)]
    _first_turn(tracker, "a", [b"short"], short)
    assert tracker.pick("b", [(b"short", False)]) == [0]  # too short to keep: indexed again
    for i in range(3):  # 6,000 tokens each: the bound keeps one
        _first_turn(tracker, f"long{i}", [f"m{i}".encode()], [_tokens(60 + i, 6000)])
    assert tracker.pick("x", [(b"m0", False)]) == [0]
    assert tracker.pick("y", [(b"m2", False)]) == []


def test_a_plan_whose_prompt_was_never_indexed_leaves_nothing_behind() -> None:
    texts = [_tokens(70 + i, 1500) for i in range(4)]
    digests = [b"sys", b"u1", b"t1", b"u2"]
    tracker = ContextTracker(PARAMS, opening_tokens=7000)
    _first_turn(tracker, "a", digests, texts)
    assert tracker.pick("b", [(d, False) for d in digests]) == []  # ... and its update then failed
    _first_turn(tracker, "other", [b"x"], [_tokens(80, 6500)])  # the bound now keeps only this opening
    _, prompt, turn, indexed = _first_turn(tracker, "b", digests, texts)
    alone = ContextTracker(PARAMS, opening_tokens=0)
    assert (prompt, turn, indexed) == _first_turn(alone, "b", digests, texts)[1:]


def test_a_prompt_indexed_in_part_is_not_kept_as_an_opening() -> None:
    texts = [_tokens(90 + i, 1500) for i in range(4)]
    digests = [b"sys", b"u1", b"t1", b"u2"]
    tracker = ContextTracker(PARAMS, idle_expiry_s=10.0)
    _first_turn(tracker, "a", digests, texts)
    later = [*digests, b"reply-a", b"u3"]
    assert tracker.pick("a", [*[(d, False) for d in digests], (b"reply-a", True), (b"u3", False)]) == [5]
    tracker.expire(100.0)  # the session expires between its pick and its fold: its prompt is indexed in part
    tracker.on_prompt("a", "p", later, [_tokens(99, 5000)], 100.0)
    assert tracker.pick("z", [(d, False) for d in later]) == [4, 5]  # from the whole first prompt, not the part
