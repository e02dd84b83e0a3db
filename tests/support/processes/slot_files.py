"""Real slot files of a first turn, by prompt length: on a running llama-server, the slot erased, a chat turn of a
system prompt of N rule lines and one user message (`max_tokens` 1, as a head is saved after a first turn), the slot
saved; its tokens (`n_saved`) and the file's bytes. Shared by the head-size test and its benchmark."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adaptive_spec.kv.heads.matching import HeadEntry
from tests.support.processes.servers import LlamaServer

_RULE = "{0}. Keep function_{0} small, typed and tested; never edit file_{0}.py unread."


@dataclass(frozen=True, slots=True)
class SlotFile:
    lines: int  # the system prompt's rule lines
    tokens: int  # what llama-server saved (`n_saved`)
    bytes: int  # the file's size


def messages(lines: int) -> list[dict[str, str]]:
    rules = "\n".join(_RULE.format(i) for i in range(lines))
    system = f"You are a coding agent in a repository. Rules:\n{rules}"
    return [{"role": "system", "content": system}, {"role": "user", "content": "Write hello.py that prints hello."}]


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1800) as resp:
        return json.loads(resp.read())


def slot_files(server: LlamaServer, slots: Path, lengths: Sequence[int]) -> list[SlotFile]:
    """For each length (rule lines), slot 0 erased, a first turn in it, the slot saved into `slots` (the server's
    --slot-save-path)."""
    out = []
    for lines in lengths:
        _post(server.url + "/slots/0?action=erase", {})
        body = {"messages": messages(lines), "max_tokens": 1, "temperature": 0, "id_slot": 0}
        _post(server.url + "/v1/chat/completions", body)
        name = f"head-{lines}.bin"
        saved = _post(server.url + "/slots/0?action=save", {"filename": name})
        out.append(SlotFile(lines, int(saved["n_saved"]), (slots / name).stat().st_size))
    return out


def as_entries(files: Sequence[SlotFile]) -> list[HeadEntry]:
    """The files as the store's index holds heads (their tokens and bytes: what `head_size` fits)."""
    return [HeadEntry(str(i), ("x",), (1,), f.tokens, f.tokens, f.bytes, 0.0, 0.0) for i, f in enumerate(files)]
