"""The tests' hosts (`tests/support/processes/hosts.py`): real namespaces that reach each other and the test over
their veths only, a link that goes down and up, nothing left after `close()` (nor after a build that failed half
way), a killed run's leftovers swept by the next; and the rule for a machine that refuses them: skipped here, failed
in CI."""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.processes import hosts as support
from tests.support.processes.hosts import Hosts
from tests.support.processes.servers import terminate, wait_until


def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(support.NEEDS_ENV, raising=False)
    monkeypatch.delenv("CI", raising=False)


def test_without_ip_the_tests_skip_here_and_fail_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    _no_env(monkeypatch)
    with pytest.raises(pytest.skip.Exception, match="apt-get install iproute2"):
        Hosts(["a"])
    monkeypatch.setenv(support.NEEDS_ENV, "1")
    with pytest.raises(BaseException, match="CI must have it") as failed:  # a skip here would be the defect
        Hosts(["a"])
    assert failed.type is pytest.fail.Exception


def test_where_namespaces_are_refused_the_tests_skip_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    real = subprocess.run

    def refusing(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if argv[:3] == ["ip", "netns", "add"]:
            return subprocess.CompletedProcess(
                argv, 1, "", "mount --make-shared /run/netns failed: Operation not permitted"
            )
        return real(argv, **kwargs)

    monkeypatch.setattr(subprocess, "run", refusing)
    _no_env(monkeypatch)
    with pytest.raises(pytest.skip.Exception, match=r"needs root, CAP_NET_ADMIN.*Operation not permitted"):
        Hosts(["a"])
    monkeypatch.setenv("CI", "true")
    with pytest.raises(BaseException, match="Operation not permitted") as failed:
        Hosts(["a"])
    assert failed.type is pytest.fail.Exception


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    made = Hosts(["a", "b"])
    yield made
    made.close()
    assert made.left() == []


def _serve(hosts: Hosts, name: str) -> subprocess.Popen[bytes]:
    argv = [*hosts.run(name), sys.executable, "-m", "http.server", "--bind", hosts.address(name), "8000"]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)


def _get(url: str, timeout: float = 5.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return int(resp.status)


def _get_from(hosts: Hosts, name: str, url: str) -> int:
    code = f"import urllib.request as u; print(u.urlopen({url!r}, timeout=5).status)"
    done = subprocess.run([*hosts.run(name), sys.executable, "-c", code], capture_output=True, text=True, check=False)
    return int(done.stdout) if done.returncode == 0 else -1


def test_hosts_reach_each_other_over_their_links_only(hosts: Hosts) -> None:
    server = _serve(hosts, "b")
    try:
        url = f"http://{hosts.address('b')}:8000/"
        wait_until(lambda: _get_from(hosts, "a", url) == 200, 30, "host a to reach host b")
        assert _get(url) == 200  # the test is a client on the same switch
        assert _get_from(hosts, "a", "http://127.0.0.1:8000/") == -1  # b's loopback is b's own
        hosts.link_down("b")
        assert hosts.link_state("b") == "DOWN" and _get_from(hosts, "a", url) == -1
        hosts.link_up("b")
        wait_until(lambda: _get_from(hosts, "a", url) == 200, 30, "host b back")
    finally:
        terminate(server, 5)


def test_a_rate_limit_is_set_and_lifted(hosts: Hosts) -> None:
    hosts.rate_limit("a", "1mbit")
    shown = subprocess.run(["tc", "-n", hosts.namespace("a"), "qdisc", "show", "dev", "eth0"], capture_output=True)
    assert b"tbf" in shown.stdout and b"rate 1Mbit" in shown.stdout, shown.stdout
    hosts.rate_limit("a", None)
    shown = subprocess.run(["tc", "-n", hosts.namespace("a"), "qdisc", "show", "dev", "eth0"], capture_output=True)
    assert b"tbf" not in shown.stdout


def test_a_build_that_fails_half_way_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Hosts] = []
    real_port = Hosts._port

    def failing_port(self: Hosts, port: str) -> None:
        made.append(self)
        if port == "b":
            raise RuntimeError("no more ports")
        real_port(self, port)

    monkeypatch.setattr(Hosts, "_port", failing_port)
    with pytest.raises(RuntimeError, match="no more ports"):
        Hosts(["a", "b"])
    assert made and made[0].left() == []


def test_a_killed_runs_namespaces_are_swept_by_the_next() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = f"asn-{gone.pid}-abcdef-a"
    subprocess.run(["ip", "netns", "add", stale], check=True, capture_output=True)
    try:
        assert stale in support.sweep_stale()
        assert stale not in support._namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], check=False, capture_output=True)
