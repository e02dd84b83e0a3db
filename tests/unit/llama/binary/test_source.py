"""`build-server --source`: the shipped patches applied to a user's own llama.cpp tree and compiled into the cache
(the compile step faked: a real one takes 10-20 minutes on 2 cores), and the error when a patch does not apply."""

from __future__ import annotations

import dataclasses
import tarfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from adaptive_spec.errors import BuildError
from adaptive_spec.llama.binary import pinned as build
from adaptive_spec.llama.binary import source as source_build
from tests.support.processes.outside import missing


@pytest.fixture(params=build.SUPPORTED_SOURCES, ids=lambda a: a.llama_cpp)
def tree(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A user's tree: the files the patches touch, from each supported source (enough for them to apply): the pin,
    and b11434 as a user with an older checkout has it."""
    archive: build.SourceArchive = request.param
    try:
        sdist = build.fetch_archive(archive, build.root_dir() / "sdist", say=lambda _m: None)
    except BuildError as exc:
        missing(f"the llama.cpp {archive.llama_cpp} source is not available here: {exc}")
    touched = sorted({f for p in build.shipped_patches() for f in p.touched_files()})
    root = build.extract_source(sdist, tmp_path / "user", only=touched, root=archive.root)
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return root


class FakeCompile:
    """cmake's steps recorded; the build step leaves a llama-server where cmake would."""

    def __init__(self) -> None:
        self.ran: list[Sequence[str]] = []

    def __call__(self, argv: Sequence[str], cwd: Path) -> None:
        self.ran.append(argv)
        if "--build" in argv:
            bin_dir = Path(argv[argv.index("--build") + 1]) / "bin"
            bin_dir.mkdir(parents=True)
            (bin_dir / "llama-server").write_text("#!/bin/sh\n")
            (bin_dir / "llama-server").chmod(0o755)


def test_a_user_tree_is_patched_compiled_into_the_cache_and_made_current(tree: Path, tmp_path: Path) -> None:
    cache, compile_ = tmp_path / "cache", FakeCompile()
    built = source_build.build_from_source(tree, cache, ("-DGGML_CUDA=on",), run=compile_, say=lambda _m: None)
    assert len(compile_.ran) == 2  # configure, build
    assert compile_.ran[0][-1] == "-DGGML_CUDA=on"
    assert built.current and built.binary.is_file()
    patches = build.shipped_patches()
    key = source_build.source_key(built.manifest.sdist_sha256, patches, ("-DGGML_CUDA=on",))
    assert built.manifest.key == key == (cache / "current").read_text().strip()
    assert built.manifest.sdist == f"source {tree.resolve()}"
    assert "spec_n_max" not in (tree / "tools" / "server" / "server-task.cpp").read_text()  # the user's tree untouched
    again = FakeCompile()
    assert source_build.build_from_source(tree, cache, ("-DGGML_CUDA=on",), run=again, say=lambda _m: None) == built
    assert again.ran == []  # the same tree, patches and CMAKE_ARGS: not compiled again


def test_a_source_tarball_builds_as_its_tree_does(tree: Path, tmp_path: Path) -> None:
    tarball = tmp_path / "llama.cpp-own.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(tree, arcname="llama.cpp-own")
    from_tree = source_build.build_from_source(tree, tmp_path / "a", (), run=FakeCompile(), say=lambda _m: None)
    from_tar = source_build.build_from_source(tarball, tmp_path / "b", (), run=FakeCompile(), say=lambda _m: None)
    assert from_tar.manifest.sdist_sha256 == from_tree.manifest.sdist_sha256
    assert from_tar.manifest.key == from_tree.manifest.key


def test_a_hunk_that_does_not_apply_is_named_with_how_to_serve_the_tree_unpatched(tree: Path, tmp_path: Path) -> None:
    task = tree / "tools" / "server" / "server-task.cpp"
    text = task.read_text()
    line = '            {"samplers",                  samplers},\n'
    assert text.count(line) == 1
    task.write_text(text.replace(line, '            {"samplers",                  sampler_names},\n'))
    compile_ = FakeCompile()
    with pytest.raises(BuildError) as caught:
        source_build.build_from_source(tree, tmp_path / "cache", (), run=compile_, say=lambda _m: None)
    message = str(caught.value)
    assert "0002-server-per-request-speculation.patch does not apply to" in message
    assert "tools/server/server-task.cpp hunk #1 (expected at line 80)" in message
    assert "adaptive-spec serve --llama-server PATH" in message
    assert compile_.ran == []
    assert not (tmp_path / "cache" / "current").exists()


def test_failed_hunks_are_read_from_patch_s_output() -> None:
    output = (
        "checking file tools/server/server-chat.cpp\n"
        "checking file tools/server/server-task.cpp\n"
        "Hunk #1 FAILED at 79.\nHunk #2 FAILED at 138.\n2 out of 2 hunks FAILED\n"
    )
    assert source_build.failed_hunks(output) == [
        source_build.FailedHunk("tools/server/server-task.cpp", 1, 79),
        source_build.FailedHunk("tools/server/server-task.cpp", 2, 138),
    ]


def test_the_tree_hash_skips_git_and_build_folders_and_sees_every_byte(tmp_path: Path) -> None:
    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "chat.cpp").write_text("a\n")
    base = source_build.tree_sha256(tmp_path)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "index").write_text("x")
    (tmp_path / "build-cuda").mkdir()
    (tmp_path / "build-cuda" / "CMakeCache.txt").write_text("y")
    assert source_build.tree_sha256(tmp_path) == base
    (tmp_path / "common" / "chat.cpp").write_text("b\n")
    assert source_build.tree_sha256(tmp_path) != base


def test_a_build_from_a_user_tree_does_not_remove_the_pinned_one(tmp_path: Path) -> None:
    pinned = build.Manifest(
        key="pinned",
        llama_cpp=build.LLAMA_CPP_BUILD,
        sdist=f"{build.SDIST_NAME}=={build.SDIST_VERSION}",
        sdist_sha256=build.SDIST_SHA256,
        patches=(),
        patch_sha256=(),
        cmake_args=(),
        recipe=build.RECIPE,
        built_unix=1.0,
    )
    own = dataclasses.replace(pinned, key="own", sdist="source /src/llama.cpp", sdist_sha256="t")
    for m in (pinned, own):
        (tmp_path / m.key).mkdir()
        (tmp_path / m.key / "build.json").write_text(m.to_json())
    assert build.prune_superseded(tmp_path, own) == []


def test_build_server_source_exits_with_the_hunk_and_the_way_to_serve_it_unpatched(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from adaptive_spec.cli.main import main

    chat = tree / "common" / "chat.cpp"
    flags = "    common_peg_parse_flags flags = COMMON_PEG_PARSE_FLAG_LENIENT;\n"
    chat.write_text(chat.read_text().replace(flags, flags.rstrip("\n") + "  // edited\n"))
    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["build-server", "--source", str(tree)]) != 0
    err = capsys.readouterr().err
    assert "0004-chat-keep-trailing-partial-delimiter.patch does not apply" in err
    assert "common/chat.cpp hunk #1" in err and "serve --llama-server PATH" in err
