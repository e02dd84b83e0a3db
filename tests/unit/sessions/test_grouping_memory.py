"""What the reply echo keeps for each served reply: an entry per reply and per line, holding its session's one id
string (a session id arrives as a new string with every request: a copy per entry was a quarter of the maps' memory
when full), and nothing beyond its bound."""

from __future__ import annotations

from typing import Any

from adaptive_spec.sessions.grouping import SessionRegistry


def _reply(i: int) -> str:
    return f"the answer number {i} says this at length\nand its second line {i} is long enough to echo"


def _echoing(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "go on"}, {"role": "assistant", "content": text}]}


def _quoting(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "commit message for:\n" + text}]}


def test_every_entry_of_a_session_holds_its_one_id_string() -> None:
    registry = SessionRegistry()
    ids = ["".join(["ses", "-a"]) for _ in range(20)]  # equal, and each its own object, as each request's is
    assert len({id(s) for s in ids}) == len(ids)
    for i, sid in enumerate(ids):
        registry.note_reply(sid, _reply(i), [f"call_{i}"])
    found = [registry.assign({}, _echoing(_reply(i))).session_id for i in range(20)]
    found += [registry.assign({}, _quoting(_reply(i))).session_id for i in range(20)]
    tool = {"messages": [{"role": "tool", "tool_call_id": "call_7", "content": "ok"}]}
    found.append(registry.assign({}, tool).session_id)
    assert found == ["ses-a"] * 41
    assert all(s is ids[0] for s in found)


def test_the_echo_forgets_the_oldest_beyond_its_bound() -> None:
    registry = SessionRegistry(max_fingerprints=4)  # 4 replies, 4 lines: the last two replies' lines
    for i in range(6):
        registry.note_reply(f"s{i}", _reply(i), [])
    echoed = [registry.assign({}, _echoing(_reply(i))) for i in range(6)]
    assert [a.source for a in echoed] == ["new", "new", "echo:reply", "echo:reply", "echo:reply", "echo:reply"]
    assert [a.session_id for a in echoed[2:]] == ["s2", "s3", "s4", "s5"]
    quoted = [registry.assign({}, _quoting(_reply(i))) for i in range(6)]
    assert [a.source for a in quoted] == ["new"] * 4 + ["echo:lines"] * 2
    assert [a.session_id for a in quoted[4:]] == ["s4", "s5"]
