from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from adaptive_spec.cli import main as cli
from adaptive_spec.policy import files as policy_files
from adaptive_spec.policy.files import SHIPPED, WORKSPACE_FILE, PolicyStore, config_dir
from adaptive_spec.policy.model import Policy, RoutePolicy
from adaptive_spec.policy.reading import PolicyError
from adaptive_spec.sessions.project import workspace_from_request, workspace_path_from_request

PROFILES = ("oneshot", "iterative")


def _write(path: Path, text: str) -> Path:
    """Write and move the mtime on, so a change is seen even within the file system's timestamp granularity."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    stamp = max(path.stat().st_mtime_ns, before + 1_000_000_000)
    os.utime(path, ns=(stamp, stamp))
    return path


def _store(tmp_path: Path, base: Path | None = None, **kwargs: bool) -> tuple[PolicyStore, list[str]]:
    logged: list[str] = []
    store = PolicyStore(base, PROFILES, tmp_path / "config", log=logged.append, **kwargs)
    return store, logged


def _project_file(tmp_path: Path, project: str) -> Path:
    return tmp_path / "config" / "policies" / f"{project}.toml"


def test_config_dir_can_be_overridden(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ADAPTIVE_SPEC_CONFIG_DIR", str(tmp_path))
    assert config_dir() == tmp_path
    monkeypatch.delenv("ADAPTIVE_SPEC_CONFIG_DIR")
    assert config_dir().name == "adaptive-spec"


def test_without_files_the_policy_is_the_shipped_default(tmp_path: Path) -> None:
    store, logged = _store(tmp_path)
    assert store.policy_for("default", None) == Policy(sources=(SHIPPED,))
    assert logged == [] and store.refresh() == [] and store.problems() == []


def test_layers_apply_base_then_project_then_workspace(tmp_path: Path) -> None:
    base = _write(tmp_path / "base.toml", "[route]\nhysteresis = 0.3\nexplore = 0.1\nmax_queue = 5\n")
    project = _write(_project_file(tmp_path, "web"), "[route]\nhysteresis = 0.4\nexplore = 0.2\n")
    workspace = tmp_path / "ws"
    ws_file = _write(workspace / WORKSPACE_FILE, "[route]\nhysteresis = 0.5\n")
    store, logged = _store(tmp_path, base)
    policy = store.load("web", str(workspace))
    assert policy.route == RoutePolicy(hysteresis=0.5, explore=0.2, max_queue=5)
    assert policy.sources == (str(base), str(project), str(ws_file))
    assert store.load("other", None).route == RoutePolicy(hysteresis=0.3, explore=0.1, max_queue=5)
    assert logged == [f"policy {base} loaded", f"policy {project} loaded", f"policy {ws_file} loaded"]
    assert store.refresh() == logged  # lines logged outside a refresh are returned by the next, for publishing


def test_a_workspace_file_applies_only_for_a_local_absolute_folder(tmp_path: Path) -> None:
    _write(tmp_path / "ws" / WORKSPACE_FILE, "[route]\nhysteresis = 0.5\n")
    store, _ = _store(tmp_path)
    assert store.load("p", "ws").route.hysteresis == 0.15  # relative: not a path on this machine
    assert store.load("p", str(tmp_path / "elsewhere")).route.hysteresis == 0.15
    assert store.load("p", "C:\\Users\\me\\ws").route.hysteresis == 0.15
    off, _ = _store(tmp_path, read_workspace_files=False)
    assert off.load("p", str(tmp_path / "ws")).route.hysteresis == 0.15


def test_a_changed_file_is_reloaded_on_refresh_only(tmp_path: Path) -> None:
    project = _write(_project_file(tmp_path, "web"), "[route]\nhysteresis = 0.4\n")
    store, _ = _store(tmp_path)
    assert store.load("web", None).route.hysteresis == 0.4
    store.refresh()
    _write(project, "[route]\nhysteresis = 0.6\n")
    assert store.policy_for("web", None).route.hysteresis == 0.4  # no stat on the request path
    assert store.refresh() == [f"policy {project} reloaded"]
    assert store.policy_for("web", None).route.hysteresis == 0.6
    assert store.refresh() == []


def test_a_bad_edit_keeps_the_last_good_version_until_fixed(tmp_path: Path) -> None:
    project = _write(_project_file(tmp_path, "web"), "[route]\nhysteresis = 0.4\n")
    store, logged = _store(tmp_path)
    store.load("web", None)
    store.refresh()
    _write(project, "[route]\nhysteresis = 0.6\nhysterisis = 0.7\n")
    expected = (
        f"policy {project} is invalid, keeping the last good version: "
        f"{project}:route.hysterisis:3: unknown key; did you mean 'hysteresis'?"
    )
    assert store.refresh() == [expected]
    assert store.refresh() == []  # said once per change, not on every refresh
    assert logged[-1] == expected
    assert store.policy_for("web", None).route.hysteresis == 0.4
    assert [str(p) for p in store.problems()] == [
        f"{project}:route.hysterisis:3: unknown key; did you mean 'hysteresis'?"
    ]
    assert store.describe("web", None)["problems"] == [str(p) for p in store.problems()]
    assert store.describe("other", None)["problems"] == []
    _write(project, "[route]\nhysteresis = 0.6\n")
    assert store.refresh() == [f"policy {project} reloaded"]
    assert store.policy_for("web", None).route.hysteresis == 0.6 and store.problems() == []


def test_a_file_bad_from_the_start_is_not_applied(tmp_path: Path) -> None:
    project = _write(_project_file(tmp_path, "web"), '[route]\nforce = "iterativ"\n')
    store, logged = _store(tmp_path)
    assert store.load("web", None) == Policy(sources=(SHIPPED,))
    assert logged == [
        f"policy {project} is invalid, not applying it: "
        f"{project}:route.force:2: unknown profile 'iterativ'; did you mean 'iterative'?"
    ]


def test_a_deleted_file_no_longer_applies(tmp_path: Path) -> None:
    project = _write(_project_file(tmp_path, "web"), "[route]\nhysteresis = 0.4\n")
    store, _ = _store(tmp_path)
    store.load("web", None)
    project.unlink()
    assert store.refresh() == [
        f"policy {project} loaded",
        f"policy {project} was removed; its settings no longer apply",
    ]
    assert store.policy_for("web", None).route.hysteresis == 0.15


def test_a_project_file_created_later_is_picked_up(tmp_path: Path) -> None:
    store, _ = _store(tmp_path)
    assert store.load("web", None).route.hysteresis == 0.15
    project = _write(_project_file(tmp_path, "web"), "[route]\nhysteresis = 0.4\n")
    assert store.refresh() == [f"policy {project} loaded"]
    assert store.policy_for("web", None).route.hysteresis == 0.4


def test_a_project_name_is_never_a_path(tmp_path: Path) -> None:
    _write(tmp_path / "config" / "evil.toml", "[route]\nhysteresis = 0.4\n")
    store, _ = _store(tmp_path)
    assert store.load("../evil", None).route.hysteresis == 0.15


def test_a_bad_base_file_stops_startup_with_every_problem(tmp_path: Path) -> None:
    base = _write(tmp_path / "base.toml", '[route]\nhysteresis = 3\nforce = "zzz"\n')
    with pytest.raises(PolicyError) as caught:
        _store(tmp_path, base)
    assert [p.key for p in caught.value.problems] == ["route.hysteresis", "route.force"]
    with pytest.raises(PolicyError, match="cannot read the file: No such file or directory"):
        _store(tmp_path, tmp_path / "missing.toml")


def test_a_base_file_that_goes_bad_keeps_its_last_good_version(tmp_path: Path) -> None:
    base = _write(tmp_path / "base.toml", "[route]\nhysteresis = 0.3\n")
    store, _ = _store(tmp_path, base)
    _write(base, "[route\n")
    assert store.refresh()[-1].startswith(f"policy {base} is invalid, keeping the last good version: {base}:1:")
    assert store.policy_for("default", None).route.hysteresis == 0.3


def test_describe_shows_the_policy_its_sources_and_problems(tmp_path: Path) -> None:
    store, _ = _store(tmp_path)
    described = store.describe("default", None)
    assert described["sources"] == [SHIPPED] and described["problems"] == []
    assert described["policy"]["route"]["force"] == "" and described["policy"]["handoff"]["enabled"] is True
    json.dumps(described)


# --- the workspace path an agent reveals ---


def test_workspace_path_is_the_whole_path_and_the_project_its_last_component() -> None:
    body = {"messages": [{"role": "system", "content": "x\nWorking directory: /home/me/src/web-app\n"}]}
    assert workspace_path_from_request({}, body) == "/home/me/src/web-app"
    assert workspace_from_request({}, body) == "web-app"
    headers = {"x-codex-turn-metadata": json.dumps({"workspaces": {"/home/me/api": {}}})}
    assert workspace_path_from_request(headers, {}) == "/home/me/api"
    assert workspace_path_from_request({}, {"system": "<cwd> '/srv/x' </cwd>"}) == "/srv/x"
    assert workspace_path_from_request({}, {"messages": []}) is None


# --- adaptive-spec policy check / show ---


def test_cli_check_reports_every_problem_and_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _write(tmp_path / "good.toml", "[route]\nhysteresis = 0.2\n")
    bad = _write(tmp_path / "bad.toml", '[route]\nexplore = 0.9\nforce = "iterativ"\n[handof]\n')
    broken = _write(tmp_path / "broken.toml", "[route]\nhysteresis = \n")
    code = cli.main(["policy", "check", str(good), str(bad), str(broken), "--profiles", "oneshot,iterative"])
    assert code == 1
    assert capsys.readouterr().out.splitlines() == [
        f"ok: {good}",
        f"{bad}:route.explore:2: must be between 0 and 0.5, got 0.9",
        f"{bad}:route.force:3: unknown profile 'iterativ'; did you mean 'iterative'?",
        f"{bad}:handof:4: unknown table; did you mean 'handoff'?",
        f"{broken}:2: invalid TOML: invalid value at column 14",
    ]


def test_cli_check_passes_good_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _write(tmp_path / "good.toml", '[route]\nforce = "oneshot"\n')
    assert cli.main(["policy", "check", str(good)]) == 0
    assert capsys.readouterr().out == f"ok: {good}\n"
    assert cli.main(["policy", "check", str(good), "--profiles", "iterative"]) == 1
    assert cli.main(["policy", "check", str(tmp_path / "missing.toml")]) == 1
    assert "cannot read the file" in capsys.readouterr().out


def test_cli_check_without_files_checks_what_a_proxy_would_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ADAPTIVE_SPEC_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    project = _write(_project_file(tmp_path, "web"), "[route]\nhysteresis = 0.2\n")
    _write(tmp_path / WORKSPACE_FILE, "[route]\nexplore = 0.6\n")
    assert cli.main(["policy", "check"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"ok: {SHIPPED}",
        f"ok: {project}",
        f"{WORKSPACE_FILE}:route.explore:2: must be between 0 and 0.5, got 0.6",
    ]


def test_cli_show_prints_the_effective_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ADAPTIVE_SPEC_CONFIG_DIR", str(tmp_path / "config"))
    project = _write(_project_file(tmp_path, "web"), '[route]\nhysteresis = 0.2\nforce = "fast"\n')
    assert cli.main(["policy", "show", "--project", "web"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# from: {SHIPPED}, {project}\n") and "\nhysteresis = 0.2\n" in out
    assert cli.main(["policy", "show", "--project", "web", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["sources"] == [SHIPPED, str(project)] and shown["policy"]["route"]["hysteresis"] == 0.2
    bad = _write(tmp_path / "bad.toml", "[route]\nhysteresis = 2\n")
    assert cli.main(["policy", "show", "--project", "web", "--profiles", "oneshot"]) == 1
    assert "route.force:3: unknown profile 'fast'" in capsys.readouterr().err
    assert cli.main(["policy", "show", "--policy", str(bad)]) == 2
    assert "bad.toml:route.hysteresis:2: must be between 0 and 1, got 2" in capsys.readouterr().err


def test_serve_refuses_a_bad_policy_before_touching_any_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    from adaptive_spec.cli.main import main

    bad = tmp_path / "bad.toml"
    bad.write_text('[route]\nhysterisis = 0.2\nforce = "iterativ"\n')
    # The port it would listen on is taken (as the default one is while a user's own `serve` runs): the bad policy
    # is still what it says, before it tries to listen.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        argv = ["serve", "--port", port, "--policy", str(bad)]
        argv += ["--profile", "oneshot=http://127.0.0.1:9", "--profile", "iterative=http://127.0.0.1:9"]
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot listen" not in err, err
    assert f"{bad}:route.hysterisis:2: unknown key; did you mean 'hysteresis'?" in err
    assert f"{bad}:route.force:3: unknown profile 'iterativ'; did you mean 'iterative'?" in err
    assert "cannot be reached" not in err  # the policy was checked first


def test_a_fifo_or_a_huge_file_in_a_workspace_is_refused_without_blocking(tmp_path: Path) -> None:
    from adaptive_spec.policy.files import MAX_POLICY_BYTES, read_policy_file

    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    _, problems = read_policy_file(fifo, "fifo.toml", None)
    assert problems and "not a regular file" in problems[0].message
    huge = tmp_path / "huge.toml"
    huge.write_text("# " + "x" * MAX_POLICY_BYTES + "\n")
    _, problems = read_policy_file(huge, "huge.toml", None)
    assert problems and "larger than" in problems[0].message


def test_the_example_project_policy_is_valid() -> None:
    from adaptive_spec.policy.reading import load_policy

    example = Path(__file__).parents[3] / "examples" / "project-policy.toml"
    policy = load_policy([(str(example), example.read_text())], known_profiles=["oneshot", "iterative"])
    assert (policy.route.hysteresis, policy.route.min_dwell_turns, policy.first_turn.min_lines) == (0.10, 1, 10)


def test_a_system_prompt_sent_again_names_its_own_workspace() -> None:
    """The scan of a text is remembered by its length and hash: texts of one length with other paths stay apart."""
    prompts = [f"You are a coding agent.\nWorking directory: /home/me/proj{i}\nBe brief." for i in range(3)]
    for _ in range(2):
        for i, prompt in enumerate(prompts):
            body = {"messages": [{"role": "system", "content": prompt}, {"role": "user", "content": "hi"}]}
            assert workspace_path_from_request({}, body) == f"/home/me/proj{i}"
    assert workspace_path_from_request({}, {"messages": [{"role": "system", "content": "no path here"}]}) is None


def test_a_known_project_is_answered_from_the_snapshot_without_touching_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the router reads while it plans is a published snapshot: no stat, no read, no lock. A project seen for
    the first time is `load`ed (the proxy does that in a thread), which publishes a new snapshot and leaves the old
    one as it was; until then, `policy_for` answers the base policy, still without a file."""
    _write(_project_file(tmp_path, "web"), "[route]\nhysteresis = 0.4\n")
    store, _ = _store(tmp_path)
    assert not store.known("web", None)
    before = store._snapshot
    assert store.load("web", None).route.hysteresis == 0.4
    assert store.known("web", None) and "web" not in {p for p, _ in before}

    def no_file(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a file was looked at")

    monkeypatch.setattr(policy_files._WatchedFile, "check", no_file)
    monkeypatch.setattr(policy_files, "_read_small_regular_file", no_file)
    assert store.policy_for("web", None).route.hysteresis == 0.4
    assert store.policy_for("api", None) == store.policy_for("default", None)  # never seen: the base, no file
    assert not store.known("api", None)  # the proxy loads it, off the loop, before it routes the request


def test_a_refresh_publishes_every_known_policy_again_and_keeps_the_base(tmp_path: Path) -> None:
    project = _write(_project_file(tmp_path, "web"), "[route]\nhysteresis = 0.4\n")
    store, _ = _store(tmp_path)
    store.load("web", None)
    store.load("default", None)
    store.refresh()  # the first says what was loaded
    first = store._snapshot
    _write(project, "[route]\nhysteresis = 0.6\n")
    assert store.refresh() == [f"policy {project} reloaded"]
    assert store._snapshot is not first and first[("web", None)].route.hysteresis == 0.4  # the old one unchanged
    assert store.known("web", None) and store.known("default", None)
    assert store.policy_for("web", None).route.hysteresis == 0.6


def test_a_pair_dropped_from_the_snapshot_gets_the_base_and_the_base_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh snapshot (a watched file dropped from the bounded tables) keeps the base policy, which `policy_for`
    answers for a pair it no longer holds, without reading a file."""
    monkeypatch.setattr(policy_files, "_MAX_TRACKED", 2)
    base = _write(tmp_path / "base.toml", "[route]\nhysteresis = 0.3\n")
    for name in ("a", "b", "c"):
        _write(_project_file(tmp_path, name), "[route]\nhysteresis = 0.4\n")
    store, _ = _store(tmp_path, base)
    assert store.load("a", None).route.hysteresis == 0.4
    store.load("b", None)  # the tables watch two projects: each load drops an older file, and starts a fresh snapshot
    store.load("c", None)
    assert store.known("default", None) and store.known("c", None) and not store.known("a", None)

    def no_file(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a file was looked at")

    monkeypatch.setattr(policy_files, "_read_small_regular_file", no_file)
    assert store.policy_for("a", None).route.hysteresis == 0.3  # the base, until it is loaded again
