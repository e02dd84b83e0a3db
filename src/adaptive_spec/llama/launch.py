"""Starting, watching and stopping the llama-server processes behind launched profiles.

No orphans, ever."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp

from adaptive_spec.common.dirs import state_dir
from adaptive_spec.errors import LaunchError
from adaptive_spec.llama.binary.cpu_faults import (
    CLEAR_HINT,
    NO_REPACK,
    REPACK_COST,
    VERDICTS_FILE,
    RepackMode,
    VerdictStore,
    fault_signal,
)
from adaptive_spec.llama.profiles import ProfileSpec, ServerSettings, server_argv

Say = Callable[[str], None]
_PR_SET_PDEATHSIG = 1
# A launched server marked down (the health poll found it hung: SIGSTOPped, wedged) this long is killed, and its
# watcher restarts it (serve --restart-hung-after).
HUNG_RESTART_S = 30.0
# On stop, how long a llama-server has between SIGTERM and SIGKILL: it acts on SIGTERM only after the batch it is
# computing (a 2048-token prefill batch of the 0.5B at -t 1 took ~60 s on a loaded 2-core machine), and with a
# request still connected it does not exit at all (b11434).
KILL_AFTER_S = 3.0


# The reason a profile is down while `POST /adaptive/profiles/{name}/restart` restarts it: it comes back empty.
RESTART_ON_REQUEST = "restarting on request"


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """Runs in the child before exec: the kernel sends it SIGTERM if adaptive-spec dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def verdict_store() -> VerdictStore:
    """This machine's CPU verdicts (llama/binary/cpu_faults.py), in the state directory."""
    return VerdictStore(state_dir() / VERDICTS_FILE)


class ServerProcess:
    """One llama-server child, started the one way this project starts them: in its own session (a terminal's Ctrl-C
    reaches the parent, which stops it in order), ended by the kernel if the parent dies, logging to a file, ready
    once `/health` answers 200. A death of a CPU-kernel fault while loading (SIGILL, SIGSEGV, SIGBUS) is retried once
    with `--no-repack`, and once that has served the verdict is kept for this build and CPU, so the next start uses
    it at once (`repack`: "auto"; "always" never adds it, "never" always does). The launcher, the test support and
    the benchmark scripts all start llama-server through it."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        base_url: str,
        log_path: Path,
        say: Say = print,
        *,
        repack: RepackMode = "auto",
        verdicts: VerdictStore | None = None,
    ) -> None:
        self.name, self.argv, self.base_url, self.log_path = name, argv, base_url, log_path
        self.process: asyncio.subprocess.Process | None = None
        self._say = say
        self._repack = repack
        self._verdicts = verdicts
        self._verdict_read = False
        self._retried_fault: signal.Signals | None = None  # the fault a --no-repack retry answers, until it serves

    @property
    def no_repack(self) -> bool:
        """Whether it runs with `--no-repack` (given, remembered, or added after a fault while loading)."""
        return NO_REPACK in self.argv

    def verdicts(self) -> VerdictStore:
        if self._verdicts is None:
            self._verdicts = verdict_store()
        return self._verdicts

    def _apply_verdict(self) -> None:
        """Before the first start: the mode's and the machine's word on repacking, said once."""
        if self._verdict_read or self.no_repack:
            self._verdict_read = True
            return
        self._verdict_read = True
        if self._repack == "never":
            self.argv.append(NO_REPACK)
        elif self._repack == "auto" and (verdict := self.verdicts().get(self.argv[0])) is not None:
            self.argv.append(NO_REPACK)
            self._say(f"profile {self.name!r}: this build runs with {verdict.describe()}; {CLEAR_HINT}; {REPACK_COST}")

    async def start(self, health_timeout_s: float) -> None:
        """Spawn it and wait until it is healthy; stops it and raises LaunchError if it is not."""
        try:
            await self.spawn()
            async with aiohttp.ClientSession() as session:
                await self.wait_healthy(session, health_timeout_s)
        except BaseException:
            await self.stop()
            raise

    async def spawn(self) -> None:
        self._apply_verdict()
        self._say(f"starting profile {self.name!r}: {' '.join(self.argv)}")
        with self.log_path.open("ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # a terminal's Ctrl-C reaches adaptive-spec, which stops children itself
                preexec_fn=_die_with_parent,
            )

    async def wait_healthy(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        started = time.monotonic()
        last_report = started
        assert self.process is not None
        while True:
            fault = fault_signal(self.process.returncode)
            if fault is not None and self._repack == "auto" and not self.no_repack:
                # Some virtual machines advertise AMX but fault on it; llama.cpp only reaches AMX through weight
                # repacking, so the same build runs once repacking is off.
                self._say(
                    f"profile {self.name!r}: llama-server died of {fault.name} while loading (a CPU kernel that "
                    f"faults on this machine); retrying with {NO_REPACK}\n{self.log_tail(5)}"
                )
                self._retried_fault = fault
                self.argv.append(NO_REPACK)
                await self.spawn()
                continue
            if self.process.returncode is not None:
                raise LaunchError(self.died_message())
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(self.base_url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        self._say(
                            f"profile {self.name!r} ready at {self.base_url} ({time.monotonic() - started:.1f} s)"
                        )
                        self._keep_verdict()
                        return
            now = time.monotonic()
            if now - started > timeout_s:
                raise LaunchError(
                    f"profile {self.name!r} was not healthy after {timeout_s:.0f} s;"
                    f" log: {self.log_path}\n{self.log_tail()}"
                )
            if now - last_report >= 3.0:
                last_report = now
                self._say(f"  {self.name}: loading ({now - started:.0f} s) {self.last_line()}")
            await asyncio.sleep(0.1)

    def _keep_verdict(self) -> None:
        fault, self._retried_fault = self._retried_fault, None
        if fault is None:
            return
        problem = self.verdicts().remember(self.argv[0], fault)
        self._say(
            problem
            or f"profile {self.name!r}: served with {NO_REPACK}; this machine remembers it for this build "
            f"({self.verdicts().path}; {CLEAR_HINT}); {REPACK_COST}"
        )

    async def stop(self, kill_after_s: float = 10.0) -> bool:
        """SIGTERM, then SIGKILL after `kill_after_s`. Safe to call more than once. True when it took a SIGKILL."""
        proc = self.process
        if proc is None or proc.returncode is not None:
            return False
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
            proc.send_signal(signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
        try:
            async with asyncio.timeout(kill_after_s):
                await proc.wait()
            return False
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            return True

    def died_message(self) -> str:
        assert self.process is not None
        return (
            f"profile {self.name!r}: llama-server exited with status {self.process.returncode} "
            f"while loading; log: {self.log_path}\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join("    " + line for line in text.splitlines()[-lines:])

    def last_line(self) -> str:
        return self.log_tail(1).strip()[:100]


class Launcher:
    """Owns one llama-server per launched profile: start, wait for /health, restart after a crash, stop."""

    def __init__(
        self,
        binary: str,
        specs: list[ProfileSpec],
        settings: ServerSettings,
        *,
        run_dir: Path,
        host: str = "127.0.0.1",
        say: Say = print,
        on_up: Callable[[str], None] = lambda _: None,
        on_down: Callable[[str, str], None] = lambda _n, _r: None,
        health_timeout_s: float = 600.0,
        repack: RepackMode = "auto",
        hung_restart_s: float = HUNG_RESTART_S,
    ) -> None:
        self._say, self._on_up, self._on_down = say, on_up, on_down
        self._hung_restart_s = hung_restart_s
        self._hung: dict[str, asyncio.TimerHandle] = {}  # server URL -> its kill, while it is marked down
        self._repack = repack
        self._health_timeout_s = health_timeout_s
        self._stopping = False
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self.run_dir = run_dir
        self._binary, self._settings, self._host = binary, settings, host
        (run_dir / "slots").mkdir(parents=True, exist_ok=True)
        (run_dir / "logs").mkdir(exist_ok=True)
        self._children: list[ServerProcess] = [self._child(spec) for spec in specs]

    def _child(self, spec: ProfileSpec) -> ServerProcess:
        port = free_port(self._host)
        slots = str(self.run_dir / "slots")
        argv = server_argv(self._binary, spec, self._settings, host=self._host, port=port, slot_save_path=slots)
        log = self.run_dir / "logs" / f"{spec.name}.log"
        return ServerProcess(spec.name, argv, f"http://{self._host}:{port}", log, self._say, repack=self._repack)

    def set_health_hooks(self, on_up: Callable[[str], None], on_down: Callable[[str, str], None]) -> None:
        """Who to tell when a profile goes down (crash) and comes back up (after a restart)."""
        self._on_up, self._on_down = on_up, on_down

    @property
    def endpoints(self) -> dict[str, str]:
        return {c.name: c.base_url for c in self._children}

    @property
    def commands(self) -> dict[str, list[str]]:
        """Each launched server's command line, by its URL (profiles that are settings of one server share it)."""
        return {c.base_url: list(c.argv) for c in self._children}

    def pids(self) -> dict[str, int]:
        return {c.name: c.process.pid for c in self._children if c.process is not None}

    async def start(self) -> None:
        """Start every profile and wait until all are healthy; on any failure stop them all and raise."""
        await self._start(self._children)

    async def add(self, specs: list[ProfileSpec]) -> None:
        """Start more profiles beside the running ones (a stock server cannot serve them all: each gets its own) and
        wait until they are healthy; on any failure stop them all and raise."""
        children = [self._child(spec) for spec in specs]
        self._children += children
        await self._start(children)

    async def _start(self, children: list[ServerProcess]) -> None:
        try:
            for child in children:
                await child.spawn()
            async with aiohttp.ClientSession() as session:
                checks = [asyncio.create_task(c.wait_healthy(session, self._health_timeout_s)) for c in children]
                try:
                    await asyncio.gather(*checks)
                finally:
                    for check in checks:  # one failed: the others stop polling before the servers are stopped
                        check.cancel()
                    await asyncio.gather(*checks, return_exceptions=True)
        except BaseException:
            await self.stop()
            raise
        for child in children:
            self._on_up(child.name)
            self._watchers[child.name] = asyncio.create_task(self._watch(child), name=f"watch-{child.name}")

    async def restart(self, name: str) -> None:
        """Stop one profile's server and start it afresh (empty KV, prompt and n-gram caches), then wait until it is
        healthy. Raises KeyError for a profile this launcher does not own, LaunchError when it does not come back."""
        child = next(c for c in self._children if c.name == name) if name in self.endpoints else None
        if child is None or self._stopping:
            raise KeyError(name)
        watcher = self._watchers.pop(name, None)
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        self._on_down(name, RESTART_ON_REQUEST)
        await child.stop()
        await child.spawn()
        try:
            async with aiohttp.ClientSession() as session:
                await child.wait_healthy(session, self._health_timeout_s)
        finally:  # up or not, it is watched again (a server that failed to come back is restarted with backoff)
            if not self._stopping:
                self._watchers[name] = asyncio.create_task(self._watch(child), name=f"watch-{name}")
        self._on_up(name)

    def server_down(self, base_url: str, reason: str) -> None:
        """A server was marked down (a hang the health poll found, or any other reason): if it is one of ours and
        still running, it is killed once it has stayed down `hung_restart_s` (its watcher then restarts it)."""
        child = next((c for c in self._children if c.base_url == base_url), None)
        proc = child.process if child is not None else None
        if child is None or proc is None or proc.returncode is not None or self._stopping or base_url in self._hung:
            return
        loop = asyncio.get_running_loop()
        self._hung[base_url] = loop.call_later(self._hung_restart_s, self._kill_hung, child, proc.pid, reason)

    def server_up(self, base_url: str) -> None:
        timer = self._hung.pop(base_url, None)
        if timer is not None:
            timer.cancel()

    def _kill_hung(self, child: ServerProcess, pid: int, reason: str) -> None:
        self._hung.pop(child.base_url, None)
        proc = child.process
        # The same process, still there: one that crashed meanwhile was restarted by its watcher (another pid).
        if self._stopping or proc is None or proc.pid != pid or proc.returncode is not None:
            return
        self._say(
            f"profile {child.name!r}: down for {self._hung_restart_s:g} s ({reason}); "
            "killing its llama-server so that it is restarted"
        )
        with contextlib.suppress(ProcessLookupError):
            proc.kill()  # SIGKILL ends a stopped process too

    async def _watch(self, child: ServerProcess) -> None:
        """Restart a profile that exits on its own, with exponential backoff (1 s doubling to 30 s)."""
        backoff = 1.0
        while not self._stopping:
            assert child.process is not None
            up_since = time.monotonic()
            code = await child.process.wait()
            if self._stopping:
                return
            reason = f"llama-server exited with status {code}"
            self._on_down(child.name, reason)
            if time.monotonic() - up_since > 60:
                backoff = 1.0
            # Died after it had served: not a loading fault, so it comes back with the same arguments.
            self._say(
                f"profile {child.name!r}: {reason}; restarting in {backoff:.0f} s (log: {child.log_path})\n"
                f"{child.log_tail(8)}"
            )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)
            if self._stopping:
                return
            await child.spawn()
            try:
                async with aiohttp.ClientSession() as session:
                    await child.wait_healthy(session, self._health_timeout_s)
            except LaunchError as exc:
                self._say(str(exc))
                await child.stop()  # a server stuck loading is killed, then restarted
                continue
            self._on_up(child.name)

    async def stop(self, kill_after_s: float = KILL_AFTER_S) -> int:
        """Stop every child: SIGTERM, then SIGKILL after `kill_after_s`. Safe to call more than once. Returns how
        many needed the SIGKILL."""
        self._stopping = True
        for timer in self._hung.values():
            timer.cancel()
        self._hung.clear()
        for task in self._watchers.values():
            task.cancel()
        for task in self._watchers.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._watchers.clear()
        return sum(await asyncio.gather(*(c.stop(kill_after_s) for c in self._children)))
