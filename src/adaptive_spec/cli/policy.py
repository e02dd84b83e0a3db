"""`adaptive-spec policy check` and `policy show`: routing policy files checked, or the policy a project gets."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from adaptive_spec.cli import text
from adaptive_spec.cli.text import add_command


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    policy = add_command(
        sub,
        "policy",
        "check routing policy files, or show the policy a project gets",
        text.POLICY,
        text.POLICY_EXAMPLES,
    )
    actions = policy.add_subparsers(dest="policy_command", required=True)
    check = add_command(
        actions,
        "check",
        "report every problem of policy files (exit 1 if any)",
        text.POLICY_CHECK,
        text.POLICY_CHECK_EXAMPLES,
    )
    check.add_argument(
        "files",
        nargs="*",
        type=Path,
        metavar="FILE",
        help="default: the shipped default, <config dir>/policies/*.toml and ./.adaptive-spec.toml",
    )
    show = add_command(
        actions,
        "show",
        "print the effective policy of a project (TOML, or JSON with --json)",
        text.POLICY_SHOW,
        text.POLICY_SHOW_EXAMPLES,
    )
    show.add_argument("--project", default="default", help="the project (default: %(default)s)")
    show.add_argument("--workspace", help="the workspace folder, whose .adaptive-spec.toml applies last")
    show.add_argument("--policy", type=Path, metavar="FILE", help="base policy file (default: the shipped one)")
    show.add_argument("--json", action="store_true", help="JSON with the sources and problems")
    for action in (check, show):
        action.add_argument(
            "--profiles", help="comma-separated profiles served: route.force and route.profiles must name them"
        )


def run(args: argparse.Namespace) -> int:
    """`policy check` and `policy show`; exit 1 when a file has problems."""
    import json

    from adaptive_spec.policy.files import PolicyStore, check_files, config_dir
    from adaptive_spec.policy.model import policy_to_toml

    known = [p for p in args.profiles.split(",") if p] if args.profiles else None
    if args.policy_command == "check":
        results = check_files(args.files, known)
        for name, problems in results:
            print("\n".join(str(p) for p in problems) if problems else f"ok: {name}")
        return 1 if any(problems for _, problems in results) else 0
    store = PolicyStore(args.policy, known, config_dir(), read_workspace_files=True)
    workspace = str(Path(args.workspace).resolve()) if args.workspace else None
    described = store.describe(args.project, workspace)
    if args.json:
        print(json.dumps(described, indent=2))
    else:
        print(policy_to_toml(store.load(args.project, workspace)), end="")
    for problem in described["problems"]:
        print(f"problem: {problem}", file=sys.stderr)
    return 1 if described["problems"] else 0
