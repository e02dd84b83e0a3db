from __future__ import annotations

from typing import Any

import pytest

from adaptive_spec.bench.table import ALL_ROUTED, baseline_profile, session_moves, summarize, to_csv, to_markdown


def _rec(
    profile: str,
    session: str,
    at: float,
    predicted: int,
    ms: float,
    drafted: int = 0,
    accepted: int = 0,
    ttst: float = 50.0,
    outcome: str = "finished",
) -> dict[str, Any]:
    timings = {
        "predicted_n": predicted,
        "predicted_ms": ms,
        "draft_n": drafted,
        "draft_n_accepted": accepted,
        "predicted_per_second": predicted / (ms / 1000),
    }
    return {
        "profile": profile,
        "session_id": session,
        "started_at_unix": at,
        "timings": timings,
        "ttft_ms": 10.0,
        "ttst_ms": ttst,
        "outcome": outcome,
    }


RECORDS = [
    _rec("plain", "a", 1, 100, 2000),  # 50 tok/s
    _rec("ngram", "a", 2, 300, 2000, drafted=250, accepted=200, ttst=90.0),  # 150 tok/s, session a moves
    _rec("plain", "b", 3, 100, 1000),  # 100 tok/s
    _rec("ngram", "a", 4, 10, 1000, outcome="failed"),  # failed requests do not count
]


def test_rows_per_profile_and_as_routed() -> None:
    rows = {r.name: r for r in summarize(RECORDS, baseline="plain")}
    assert list(rows) == ["plain", "ngram", ALL_ROUTED]
    plain, ngram, routed = rows["plain"], rows["ngram"], rows[ALL_ROUTED]
    assert plain.decode_tok_s == pytest.approx(200 / 3.0)
    assert plain.decode_tok_s_median == pytest.approx(75.0)
    assert ngram.decode_tok_s == pytest.approx(150.0) and ngram.ratio_to_baseline == pytest.approx(2.25)
    assert ngram.acceptance == pytest.approx(0.8) and ngram.output_from_drafts == pytest.approx(200 / 300)
    assert plain.acceptance is None and plain.ratio_to_baseline == pytest.approx(1.0)
    assert routed.requests == 3 and routed.session_moves == 1 and routed.ttst_ms_median == 50.0


def test_the_moves_column_adds_up() -> None:
    """Each move is counted on the profile the session moved to; the profiles' counts sum to the total."""
    records = [*RECORDS, _rec("plain", "a", 5, 10, 1000), _rec("ngram", "b", 6, 10, 1000)]
    rows = {r.name: r for r in summarize(records, baseline="plain")}
    assert rows["ngram"].session_moves == 2 and rows["plain"].session_moves == 1  # a: →ngram, →plain; b: →ngram
    assert rows[ALL_ROUTED].session_moves == 3 == rows["ngram"].session_moves + rows["plain"].session_moves


def test_moves_count_profile_changes_within_a_session() -> None:
    assert session_moves(RECORDS) == 1  # a: plain → ngram → ngram; b: one request
    assert session_moves([_rec("p", "x", 1, 1, 1), _rec("p", "x", 2, 1, 1)]) == 0


def test_outputs_and_baseline_detection() -> None:
    rows = summarize(RECORDS, baseline=None)
    assert all(r.ratio_to_baseline is None for r in rows)
    table = to_markdown(rows, None)
    assert table.splitlines()[0].startswith("| profile | requests |") and "| ngram | 1 | 300 | 150.0 |" in table
    assert to_csv(rows).splitlines()[0].startswith("name,requests,output_tokens,decode_tok_s")
    assert (
        baseline_profile([{"name": "it", "spec_types": ["ngram-mod"]}, {"name": "one", "spec_types": ["none"]}])
        == "one"
    )
