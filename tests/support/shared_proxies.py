"""Several `serve` processes on one real llama-server (the tiny random-weight model, one slot, a slot folder both
reach), each with its own state directory on one host: what the tests of the shared state start."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.support.processes.servers import LlamaServer, ProxyProcess, http_json

SYSTEM = "You are a coding agent. Rules:\n" + "\n".join(
    f"{i}. Keep function_{i} small, typed and tested; never edit file_{i}.py without reading it." for i in range(40)
)
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write hello.py."}]


def one_slot_server(binary: str, model: Path, work: Path, port: int | None = None) -> LlamaServer:
    """A llama-server of one slot saving its slots in `work / "slots"` (`port`: where one stopped comes back)."""
    slots = work / "slots"
    slots.mkdir(exist_ok=True)
    args = ("-c", "8192", "--parallel", "1", "--spec-type", "none", "--slot-save-path", str(slots), "--metrics")
    return LlamaServer(binary, model, *args, log_dir=work / "logs", port=port)


def proxies(
    url: str,
    slots: Path,
    home: Path,
    *extra: str,
    names: tuple[str, ...] = ("a", "b"),
    profiles: Sequence[str] = (),
) -> list[ProxyProcess]:
    """One `serve` per name on the server at `url` (its profile "plain"; or on `profiles`, `--profile` arguments),
    each with its own state and config folders under `home`."""
    out = []
    for name in names:
        env = {"ADAPTIVE_SPEC_STATE_DIR": str(home / name / "state"), "ADAPTIVE_SPEC_CONFIG_DIR": str(home / name)}
        attach = profiles or ("--profile", f"plain={url}")
        out.append(ProxyProcess(*attach, "--slot-dir", str(slots), *extra, env=env))
    return out


def heads_listed(proxy: ProxyProcess, count: int) -> list[dict[str, Any]]:
    """The proxy's heads once it lists `count` of them (a save and a head taken from another proxy are told later)."""
    deadline = time.monotonic() + 30
    while len(heads := http_json(proxy.base + "/adaptive/heads")["heads"]) != count:
        assert time.monotonic() < deadline, (heads, proxy.log())
        time.sleep(0.1)
    return list(heads)
