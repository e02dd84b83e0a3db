"""`serve` takes its listening address before it launches anything: a taken port is refused at once, by name."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from adaptive_spec.errors import ConfigError, LaunchError
from adaptive_spec.proxy.run import base_url, listen
from adaptive_spec.sessions.token_source import local_model


def test_a_taken_port_is_refused_naming_host_and_port() -> None:
    first = listen("127.0.0.1", 0)
    port = first[0].getsockname()[1]
    try:
        with pytest.raises(LaunchError, match=rf"cannot listen on 127\.0\.0\.1:{port}: Address already in use"):
            listen("127.0.0.1", port)
    finally:
        for sock in first:
            sock.close()


def test_the_port_is_held_from_the_start() -> None:
    sockets = listen("127.0.0.1", 0)
    try:
        port = sockets[0].getsockname()[1]
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        assert base_url("127.0.0.1", sockets[0]) == f"http://127.0.0.1:{port}"
    finally:
        for sock in sockets:
            sock.close()


def test_an_unknown_host_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"--host 'no-such-host\.invalid'"):
        listen("no-such-host.invalid", 0)


def test_ipv6_addresses_are_bracketed() -> None:
    try:
        sockets = listen("::1", 0)
    except LaunchError:
        pytest.skip("no IPv6 loopback here")
    try:
        assert base_url("::1", sockets[0]) == f"http://[::1]:{sockets[0].getsockname()[1]}"
    finally:
        for sock in sockets:
            sock.close()


def test_an_attached_servers_model_is_read_here_only_when_it_is_this_machines_gguf(tmp_path: Path) -> None:

    gguf, other = tmp_path / "m.gguf", tmp_path / "notes.txt"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    other.write_bytes(b"hello")
    assert local_model("http://127.0.0.1:8080", str(gguf))
    assert local_model("http://localhost:8080", str(gguf))
    assert local_model("http://[::1]:8080", str(gguf))
    assert not local_model("http://10.0.0.5:8080", str(gguf))  # another machine's path may be another file here
    assert not local_model("http://127.0.0.1:8080", str(other))  # not a GGUF
    assert not local_model("http://127.0.0.1:8080", str(tmp_path / "missing.gguf"))
    assert not local_model("http://127.0.0.1:8080", "m.gguf")  # relative: the server's working directory
    assert not local_model("http://127.0.0.1:8080", "")
