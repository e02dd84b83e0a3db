"""What `adaptive-spec --help` and each command's `--help` tell a user: what the command does for them, and examples;
and `add_command`, the one way a command is declared with them."""

from __future__ import annotations

import argparse


def add_command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, summary: str, description: str, examples: str
) -> argparse.ArgumentParser:
    """A command: its line in the parent's help, what it does for the user, and its examples, kept in their columns."""
    return sub.add_parser(
        name,
        help=summary,
        description=description,
        epilog=examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


MAIN = """\
An OpenAI-compatible proxy in front of llama.cpp's llama-server. It runs one model under several speculative-decoding
profiles and sends each request from your editor or coding agent to the profile that will finish it soonest."""

MAIN_EXAMPLES = """\
examples:
  adaptive-spec serve                         serve the embedded 0.5B model on http://127.0.0.1:8088/v1
  export OPENAI_BASE_URL=http://127.0.0.1:8088/v1 OPENAI_API_KEY=local      then start your agent
  adaptive-spec serve --help                  every serve option: your own GGUF, draft models, servers you run
  adaptive-spec bench --out results/          compare the profiles on a running adaptive-spec
  adaptive-spec report run.jsonl              per-profile speeds from a `serve --trace run.jsonl`
  adaptive-spec tui                           watch acceptance, sessions and routing live

Each command's --help says more (adaptive-spec COMMAND --help)."""

SERVE = """\
Launch llama-server profiles of one model (or attach to llama-servers you run), then serve an OpenAI-compatible API
that routes each request to the profile that will finish it soonest. Ctrl-C stops it and every server it launched."""

SERVE_EXAMPLES = """\
examples:
  adaptive-spec serve                                  embedded Qwen2.5-Coder-0.5B, profiles oneshot + iterative
  adaptive-spec serve --port 9000 --trace run.jsonl    another port; record every request for `adaptive-spec report`
  adaptive-spec serve --model M.gguf --draft D.gguf --draft-type dflash
  adaptive-spec serve --model embedded:qwen2.5-coder-1.5b --draft embedded:qwen2.5-coder-0.5b --draft-type simple
  adaptive-spec serve --profile oneshot=http://127.0.0.1:8080 --profile iterative=http://127.0.0.1:8081"""

BENCH = """\
Run workloads (iterative edit sessions, one-shot prompts, a mix) through a running adaptive-spec on each of its
profiles in turn, and print per profile: tokens per second, draft acceptance, time to first token. --adaptive adds
the proxy's own routing; --simulate replays the workloads through the routing policy without any server."""

BENCH_EXAMPLES = """\
examples:
  adaptive-spec bench                                   every built-in workload on every profile of :8088
  adaptive-spec bench --workload iterative --adaptive --max-tokens 128
  adaptive-spec bench --repeat 3 --out results/         results/bench.csv, bench.json, bench.md, bench.png
  adaptive-spec bench --simulate gpu                    what routing gains at the published DFlash speeds"""

REPORT = """\
Read the trace files `serve --trace` writes and print one row per profile: tokens per second, draft acceptance, time
to first and second token, and ratios against a baseline profile."""

REPORT_EXAMPLES = """\
examples:
  adaptive-spec serve --trace run.jsonl                 then use your agent as usual, and Ctrl-C
  adaptive-spec report run.jsonl
  adaptive-spec report run.jsonl --baseline oneshot --out report/   also report.csv, report.md, report.png"""

MODEL = """\
Print the path of an embedded GGUF model (it ships as Python packages), assembling and checking it on first use:
for running llama-server or other tools on the same model yourself."""

MODEL_EXAMPLES = """\
examples:
  adaptive-spec model                                   the default, Qwen2.5-Coder-0.5B-Instruct Q4_K_M
  llama-server -m "$(adaptive-spec model)" --port 8080"""

POLICY = """\
Routing policy files decide which profile a project's requests go to. Check files for mistakes before serving, or
show the policy one project gets after the shipped default, your config directory and its workspace file apply."""

POLICY_EXAMPLES = """\
examples:
  adaptive-spec policy check                            the shipped default, your policies and ./.adaptive-spec.toml
  adaptive-spec policy show --project myproject --workspace ~/code/myproject"""

POLICY_CHECK = """\
Report every problem in policy files at once, as file:key:line with a suggestion; exit status 1 if there is any."""

POLICY_CHECK_EXAMPLES = """\
examples:
  adaptive-spec policy check
  adaptive-spec policy check my-policy.toml --profiles oneshot,iterative"""

POLICY_SHOW = """\
Print the policy a project's requests are routed by, with every file applied: TOML, or JSON with its sources."""

POLICY_SHOW_EXAMPLES = """\
examples:
  adaptive-spec policy show                             the policy of requests without a /p/<project>/ prefix
  adaptive-spec policy show --project myproject --workspace ~/code/myproject --json"""
