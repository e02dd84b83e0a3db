from __future__ import annotations

import pytest

from adaptive_spec.errors import ConfigError
from adaptive_spec.llama.profiles import (
    AttachedProfile,
    ModelSource,
    NgramModParams,
    ProfileInfo,
    ServerSettings,
    default_profiles,
    model_mismatch,
    server_argv,
)


def _argv(draft_type: str | None, draft: ModelSource | None = None) -> tuple[list[str], list[str]]:
    settings = ServerSettings(model=ModelSource(path="/m/t.gguf"), draft=draft, ctx_size=4096, threads=1)
    one, it = default_profiles(draft_type, NgramModParams(12, 16, 48))[:2]
    args = {"host": "127.0.0.1", "port": 9000, "slot_save_path": "/s"}
    return server_argv("llama-server", one, settings, **args), server_argv("llama-server", it, settings, **args)  # type: ignore[arg-type]


def _after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_embedded_pair_is_plain_and_ngram_mod() -> None:
    one, it = _argv(None)
    assert _after(one, "--spec-type") == "none"
    assert _after(it, "--spec-type") == "ngram-mod"
    assert (_after(it, "--spec-ngram-mod-n-match"), _after(it, "--spec-ngram-mod-n-min")) == ("12", "16")
    assert _after(it, "--spec-ngram-mod-n-max") == "48"
    assert "--spec-ngram-mod-n-match" not in one
    for argv in (one, it):
        assert _after(argv, "-m") == "/m/t.gguf"
        assert (_after(argv, "-t"), _after(argv, "-c"), _after(argv, "--slot-save-path")) == ("1", "4096", "/s")
        assert "--metrics" in argv and "--jinja" in argv and "-md" not in argv


def test_dflash_pair_is_drafter_then_drafter_plus_ngram_mod() -> None:
    one, it = _argv("dflash", ModelSource(path="/m/dflash.gguf"))
    assert _after(one, "--spec-type") == "draft-dflash"
    assert _after(it, "--spec-type") == "draft-dflash,ngram-mod"
    for argv in (one, it):
        assert _after(argv, "-md") == "/m/dflash.gguf"
        assert _after(argv, "--spec-draft-n-max") == "15"
        assert _after(argv, "-fa") == "on"


def test_a_drafter_adds_plain_and_ngram_as_settings_of_the_one_server_only() -> None:
    specs = default_profiles("simple", NgramModParams(12, 16, 48))
    assert [(s.name, s.spec_types, s.shared_only) for s in specs] == [
        ("oneshot", ("draft-simple",), False),
        ("iterative", ("draft-simple", "ngram-mod"), False),
        ("plain", ("none",), True),
        ("ngram", ("ngram-mod",), True),
    ]
    assert len(default_profiles(None, NgramModParams())) == 2  # without a drafter, the pair is every setting


def test_hf_sources_pass_through() -> None:
    assert ModelSource.parse("hf:org/repo:Q4_K_M").args(draft=False) == ["-hf", "org/repo:Q4_K_M"]
    assert ModelSource.parse("hf:org/d").args(draft=True) == ["-hfd", "org/d"]


def test_drafter_without_draft_model_is_refused() -> None:
    with pytest.raises(ConfigError, match="no --draft was given"):
        _argv("simple")


def test_mtp_needs_no_draft_file() -> None:
    one, _ = _argv("mtp")
    assert _after(one, "--spec-type") == "draft-mtp" and "-md" not in one


def test_unknown_draft_type() -> None:
    with pytest.raises(ConfigError, match="choose one of: dflash, mtp, eagle3, simple"):
        default_profiles("medusa", NgramModParams())


def test_attached_profile_parsing() -> None:
    assert AttachedProfile.parse("fast=http://127.0.0.1:8080/") == AttachedProfile("fast", "http://127.0.0.1:8080")
    routed = AttachedProfile.parse("it=http://h:1#ngram")
    assert routed.upstream_model == "ngram"
    for bad in ("nourl", "x=ftp://h", "=http://h", "bad name=http://h"):
        with pytest.raises(ConfigError):
            AttachedProfile.parse(bad)


def _info(name: str, path: str) -> ProfileInfo:
    return ProfileInfo(name, f"http://{name}", None, path, "", 4096, 1, None, None)


def test_model_mismatch_names_both_profiles() -> None:
    assert model_mismatch([_info("a", "/x/m.gguf"), _info("b", "/y/m.gguf")]) is None
    message = model_mismatch([_info("a", "/x/m.gguf"), _info("b", "/x/other.gguf")])
    assert message is not None
    assert "'a' serves 'm.gguf'" in message and "'b' serves 'other.gguf'" in message
