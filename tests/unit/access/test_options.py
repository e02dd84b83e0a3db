"""`serve`'s access options: where the key comes from, and the refusal to listen beyond loopback without one."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from adaptive_spec.access.options import KEY_ENV, access_policy, add_access_arguments, describe_access
from adaptive_spec.errors import ConfigError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    add_access_arguments(parser)
    return parser.parse_args(list(argv))


def test_no_key_on_loopback_is_fine_and_said(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    policy = access_policy(_args(), ["sk-project"])
    assert not policy.keys_required  # project keys alone name projects; they do not lock the proxy
    assert describe_access(policy) == (
        "access: no API key; Host localhost, 127.0.0.1, [::1]; no CORS; slot actions refused"
    )


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "devbox.lan"])
def test_listening_beyond_loopback_needs_a_key(monkeypatch: pytest.MonkeyPatch, host: str) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ConfigError) as caught:
        access_policy(_args("--host", host), [])
    assert "--api-key" in str(caught.value) and "--insecure-no-key" in str(caught.value)
    assert not access_policy(_args("--host", host, "--insecure-no-key"), []).keys_required


def test_the_key_from_flag_environment_or_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(KEY_ENV, "from-env")
    assert access_policy(_args("--host", "0.0.0.0"), ["pk"]).api_keys == ("from-env", "pk")
    assert access_policy(_args("--api-key", "from-flag"), []).api_keys == ("from-flag",)
    key_file = tmp_path / "key"
    key_file.write_text("from-file\nignored\n")
    policy = access_policy(_args("--api-key-file", str(key_file), "--host", "192.168.1.5"), [])
    assert policy.api_keys == ("from-file",)
    assert policy.allowed_hosts == ("localhost", "127.0.0.1", "[::1]", "192.168.1.5")
    key_file.write_text("\n")
    with pytest.raises(ConfigError, match="first line is empty"):
        access_policy(_args("--api-key-file", str(key_file)), [])
    with pytest.raises(ConfigError, match="give one of them"):
        access_policy(_args("--api-key-file", str(key_file), "--api-key", "k"), [])
    with pytest.raises(ConfigError, match="--allow-host"):
        access_policy(_args("--allow-host", "a b"), [])
