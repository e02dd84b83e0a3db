"""Hosts of a test's own, made of Linux network namespaces: each host is a namespace with one link (`eth0`, a veth)
into a switch (a bridge in a namespace of its own), and the test's process is one more port on that switch, so it
reaches every host as a client would. Addresses are in 198.18.0.0/15 (set aside for benchmarking networks), on those
veths only: nothing is routed or leaves the machine. Names carry the creating process's id and a random part, so runs
side by side do not collide; everything goes when the `Hosts` closes, and what a killed run left is swept by the next.

Namespaces need root (CAP_NET_ADMIN) and iproute2's `ip`: without them a test skips here and fails in CI (`.ci/run`
installs iproute2 and says so with ADAPTIVE_SPEC_NEEDS_NETNS)."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Sequence

import pytest

from tests.support.processes.outside import missing
from tests.support.processes.servers import pid_alive

NEEDS_ENV = "ADAPTIVE_SPEC_NEEDS_NETNS"
_PREFIX = "asn-"  # every namespace this module makes: asn-<pid>-<random>-<host>
_OURS = re.compile(rf"^{_PREFIX}(\d+)-[0-9a-f]+-")


def unavailable(what: str) -> None:
    """Skip on a developer's machine; fail in CI, where the hosts must be there."""
    if os.environ.get(NEEDS_ENV):
        pytest.fail(f"{what} (CI must have it: .ci/run installs iproute2 and runs as root)")
    missing(what)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def sweep_stale() -> list[str]:
    """Delete the namespaces a run that is gone left behind (killed before its teardown)."""
    gone = []
    for name in _namespaces():
        found = _OURS.match(name)
        if found and not pid_alive(int(found.group(1))):
            _ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


def _free_subnet() -> str:
    """A /24 of 198.18.0.0/15 that no route of this machine uses yet ("198.18.X")."""
    routes = _ip("-4", "route", "show", "table", "all").stdout
    for _ in range(64):
        third = secrets.randbelow(512)
        net = f"198.{18 + third // 256}.{third % 256}"
        if f"{net}." not in routes:
            return net
    raise RuntimeError("no free /24 in 198.18.0.0/15")


class Hosts:
    """One namespace per name in `names`, each at its own address on the switch; `close()` removes them all."""

    def __init__(self, names: Sequence[str]) -> None:
        if shutil.which("ip") is None:
            unavailable("iproute2's `ip` not found (Debian: apt-get install iproute2)")
        sweep_stale()
        self.token = f"{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{_PREFIX}{self.token}-switch"
        self.client_link = f"asn{secrets.token_hex(4)}"  # the test's own port, in this namespace: 11 characters
        self.names = list(names)
        self.net = ""
        self._made: list[str] = []
        try:
            probe = _ip("netns", "add", self.switch, check=False)
            if probe.returncode != 0:
                unavailable(f"cannot make a network namespace (needs root, CAP_NET_ADMIN): {probe.stderr.strip()}")
            self._made.append(self.switch)
            self.net = _free_subnet()
            self._build()
        except BaseException:
            self.close()
            raise

    @property
    def client_address(self) -> str:
        """The test process's own address on the switch."""
        return f"{self.net}.1"

    def address(self, name: str) -> str:
        return f"{self.net}.{10 + self.names.index(name)}"

    def namespace(self, name: str) -> str:
        return f"{_PREFIX}{self.token}-{name}"

    def run(self, name: str) -> list[str]:
        """The argv prefix that starts a command on host `name` (`ip netns exec` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.namespace(name)]

    def _build(self) -> None:
        sw = self.switch
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        _ip("link", "add", self.client_link, "type", "veth", "peer", "name", "client", "netns", sw)
        self._port("client")
        _ip("addr", "add", f"{self.client_address}/24", "dev", self.client_link)
        _ip("link", "set", self.client_link, "up")
        for name in self.names:
            ns = self.namespace(name)
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", name, "netns", sw)
            self._port(name)
            _ip("-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def _port(self, port: str) -> None:
        _ip("-n", self.switch, "link", "set", "dev", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", "dev", port, "up")

    def link_down(self, name: str) -> None:
        """Host `name`'s link goes down (its veth, as a pulled cable): nothing reaches it, nothing leaves it."""
        _ip("-n", self.namespace(name), "link", "set", "eth0", "down")

    def link_up(self, name: str) -> None:
        _ip("-n", self.namespace(name), "link", "set", "eth0", "up")

    def link_state(self, name: str) -> str:
        return _ip("-n", self.namespace(name), "-br", "link", "show", "eth0").stdout.split()[1]

    def rate_limit(self, name: str, rate: str | None) -> None:
        """Host `name`'s link limited to `rate` (tc's units: "8mbit") each way, by a token bucket on both ends of its
        veth; None lifts it."""
        if shutil.which("tc") is None:
            unavailable("iproute2's `tc` not found (Debian: apt-get install iproute2)")
        ends = (("-n", self.namespace(name)), "eth0"), (("-n", self.switch), name)
        for where, dev in ends:
            if rate is None:
                subprocess.run(["tc", *where, "qdisc", "del", "dev", dev, "root"], capture_output=True, check=False)
                continue
            argv = ["tc", *where, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate]
            done = subprocess.run([*argv, "burst", "32kb", "latency", "2s"], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")

    def close(self) -> None:
        """Remove every namespace made (their veths go with them) and the test's own port."""
        _ip("link", "del", self.client_link, check=False)
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()

    def left(self) -> list[str]:
        """This run's namespaces and link still on the machine (none after `close`)."""
        names = [n for n in _namespaces() if n.startswith(f"{_PREFIX}{self.token}-")]
        link = _ip("link", "show", self.client_link, check=False)
        return names + ([self.client_link] if link.returncode == 0 else [])
