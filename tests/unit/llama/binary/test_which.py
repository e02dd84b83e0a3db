"""Which llama-server a launch runs (llama/binary/which.py): whether its `/v1/messages` requests may name a slot."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaptive_spec.llama.binary import which
from adaptive_spec.llama.binary.pinned import Built, Manifest
from adaptive_spec.llama.upstreams import Upstream, UpstreamTable


def _built(tmp_path: Path, patches: tuple[str, ...]) -> Built:
    binary = tmp_path / "llama-server"
    binary.write_text("")
    manifest = Manifest(
        "k", "b11549", "xllamacpp==2026.10.11549", "0" * 64, patches, ("0" * 64,) * len(patches), (), 1, 0
    )
    return Built(binary, manifest, current=True)


def test_only_the_patched_build_with_the_messages_slot_patch_names_slots_on_messages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with_it = _built(tmp_path, ("0005-server-anthropic-tool-choice-none.patch", which.MESSAGES_SLOT_PATCH))
    monkeypatch.setattr(which, "find_built", lambda: with_it)
    assert which.passes_messages_slot(str(with_it.binary))
    assert not which.passes_messages_slot("/usr/bin/llama-server")  # another binary: a stock one, say
    older = _built(tmp_path, ("0005-server-anthropic-tool-choice-none.patch",))  # built from older patch files
    monkeypatch.setattr(which, "find_built", lambda: older)
    assert not which.passes_messages_slot(str(older.binary))
    monkeypatch.setattr(which, "find_built", lambda: None)
    assert not which.passes_messages_slot(str(with_it.binary))


def test_the_table_names_slots_on_messages_only_when_every_server_takes_them() -> None:
    patched = Upstream("iterative", "http://a", messages_slot=True)
    assert UpstreamTable([patched, Upstream("oneshot", "http://a", messages_slot=True)]).messages_slot
    assert not UpstreamTable([patched, Upstream("oneshot", "http://b")]).messages_slot  # one attached: not known
