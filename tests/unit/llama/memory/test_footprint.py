"""llama/memory/footprint.py: which launched profiles keep rollback copies of a recurrent state (llama.cpp's n_rs_seq)
and how many."""

from __future__ import annotations

import pytest

from adaptive_spec.llama.memory.footprint import rollback_states
from adaptive_spec.llama.profiles import ModelSource, ProfileSpec, ServerSettings

SETTINGS = ServerSettings(ModelSource(path="/m/target.gguf"), draft=ModelSource(path="/m/d.gguf"), draft_n_max=12)


@pytest.mark.parametrize(
    ("types", "copies"),
    [
        (("none",), 0),
        (("ngram-mod",), 0),
        (("draft-dflash",), 12),
        (("draft-dflash", "ngram-mod"), 12),
        (("draft-eagle3",), 12),
        (("draft-simple",), 0),  # a plain draft model: llama.cpp keeps no rollback copies for it
        (("draft-mtp",), 3),  # the target's own head, launched without --spec-draft-n-max: llama.cpp's 3
    ],
)
def test_rollback_copies_per_speculation_type(types: tuple[str, ...], copies: int) -> None:
    assert rollback_states(ProfileSpec("p", types), SETTINGS) == copies
