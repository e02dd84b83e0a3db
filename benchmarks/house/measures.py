"""The house's measures (docs/module-map.md): modules per folder, the longest modules, import arrows and circles, pairs
of places that repeat each other, and the walk of one request through the proxy, for this tree and, in the same run,
for others (an earlier commit's checkout).

Run:  .venv/bin/python -m benchmarks.house.measures [--other NAME=TREE ...] [--out benchmarks/results/house.json]

A folder's modules are its `.py` files less `__init__.py`, counted for `src/adaptive_spec`, `benchmarks` and `tests`
(target: 12 at most). An arrow is one module importing another of the package (an `import` anywhere in it, type-only
ones included); a circle is a set of modules that reach each other through arrows (a strongly connected component of
more than one module). A pair of places repeats when two stretches of `.py` files of one area (`src`, `benchmarks`,
`tests`) share six consecutive lines or more, compared stripped, blank and comment lines left out (a longer shared
stretch is one pair). The walk: the modules a chat request's calls enter, in order, on its second turn of a session,
through the proxy built in-process (`build_app`) in front of the fast fake llama-server
(`tests/support/fakes/fast_upstream.py`), under `sys.setprofile`; rooms are the distinct modules entered, returns the
times the walk comes back into a module it had left. Each tree's walk runs in a process of its own with that tree's
`src/` first on its path (the median of five requests)."""

from __future__ import annotations

import argparse
import ast
import asyncio
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson

from benchmarks.harness import RESULTS, ROOT
from benchmarks.harness.results import write
from benchmarks.harness.stats import percentile

PACKAGE = "adaptive_spec"
LIMIT = 12
SAME_LINES = 6
AREAS = ("src", "benchmarks", "tests")


def folders(tree: Path) -> dict[str, int]:
    """Modules per folder, for the source, the benchmarks and the tests."""
    counts: dict[str, int] = {}
    for top in (tree / "src" / PACKAGE, tree / "benchmarks", tree / "tests"):
        if not top.is_dir():
            continue
        for folder in [top, *(p for p in top.rglob("*") if p.is_dir())]:
            if "__pycache__" in folder.parts or any(part.startswith(".") for part in folder.relative_to(tree).parts):
                continue
            n = sum(1 for f in folder.glob("*.py") if f.name != "__init__.py")
            if n:
                counts[str(folder.relative_to(tree))] = n
    return counts


def _module_name(src: Path, path: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(name: str, path: Path, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules that a module imports, anywhere in it."""
    out: set[str] = set()
    here = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `from a.b import c` names a module or something in one
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph(tree: Path) -> tuple[dict[str, set[str]], dict[str, int]]:
    """Each module's arrows to the package's other modules, and each module's lines."""
    src = tree / "src"
    paths = {_module_name(src, p): p for p in (src / PACKAGE).rglob("*.py") if "__pycache__" not in p.parts}
    known = set(paths)
    arrows = {name: _imports(name, p, p.name == "__init__.py", known) for name, p in paths.items()}
    # An arrow to a package's __init__ alone (`import adaptive_spec`) is no arrow between modules.
    for name in arrows:
        arrows[name].discard(PACKAGE)
    lines = {name: len(p.read_text().splitlines()) for name, p in paths.items() if p.name != "__init__.py"}
    return arrows, lines


def circles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(arrows):
        if root in index:
            continue
        work = [(root, iter(sorted(arrows[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on.add(step)
                    work.append((step, iter(sorted(arrows.get(step, ())))))
                elif step in on:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def package_arrows(arrows: dict[str, set[str]]) -> int:
    """Arrows between the package's first-level packages (one per ordered pair)."""

    def top(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else "(top)"  # a first-level module is a room of its own

    return len({(top(a), top(b)) for a, targets in arrows.items() for b in targets if top(a) != top(b)})


def _code_lines(path: Path) -> list[str]:
    """A module's lines as they are compared: stripped, blank and comment lines left out."""
    stripped = (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in stripped if line and not line.startswith("#")]


def duplicates(tree: Path, area: str, size: int = SAME_LINES) -> int:
    """Pairs of places in `area` that share `size` consecutive lines or more (`_code_lines`); a longer shared stretch
    is one pair, and a file's stretch never pairs with one overlapping it."""
    windows: dict[tuple[str, ...], list[tuple[str, int]]] = {}
    for path in sorted((tree / area).rglob("*.py")):
        lines, name = _code_lines(path), str(path.relative_to(tree))
        for i in range(len(lines) - size + 1):
            windows.setdefault(tuple(lines[i : i + size]), []).append((name, i))
    pairs = {
        (a, b)
        for places in windows.values()
        for n, a in enumerate(places)
        for b in places[n + 1 :]
        if a[0] != b[0] or b[1] - a[1] >= size
    }
    return sum(1 for (f, i), (g, j) in pairs if ((f, i - 1), (g, j - 1)) not in pairs)


def static(tree: Path) -> dict[str, Any]:
    counts = folders(tree)
    arrows, lines = graph(tree)
    return {
        "folders": len(counts),
        "modules": sum(counts.values()),
        "over_limit": {folder: n for folder, n in sorted(counts.items(), key=lambda kv: -kv[1]) if n > LIMIT},
        "longest": sorted(lines.items(), key=lambda kv: -kv[1])[:8],
        "src_modules": len(lines),
        "src_lines": sum(lines.values()),
        "arrows": sum(len(t) for t in arrows.values()),
        "package_arrows": package_arrows(arrows),
        "circles": circles(arrows),
        "duplicates": {area: duplicates(tree, area) for area in AREAS},
    }


# --- the walk of one request ----------------------------------------------------------------------------------


def walk_rooms(modules: Iterable[str]) -> tuple[int, int, int]:
    """Rooms entered, returns and steps of a walk given as the module of each call, in order."""
    steps: list[str] = []
    for module in modules:
        if not steps or steps[-1] != module:
            steps.append(module)
    seen: set[str] = set()
    returns = 0
    for module in steps:
        returns += module in seen
        seen.add(module)
    return len(seen), returns, len(steps)


def _profiler(calls: list[str]) -> Any:
    """A profile function that notes the module of each call into the package."""

    def profile(frame: Any, event: str, _: Any) -> None:
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            if module.startswith(PACKAGE + "."):
                calls.append(module.removeprefix(PACKAGE + "."))

    return profile


async def _walk_once() -> list[tuple[int, int, int]]:
    import aiohttp
    from aiohttp.test_utils import TestServer
    from tests.support.fakes.fast_upstream import FastUpstream
    from tests.support.processes.servers import free_port

    from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
    from adaptive_spec.proxy.app import ProxySettings, build_app

    fake = FastUpstream(chunks=16)
    url = await fake.start()
    proxy = TestServer(build_app(UpstreamTable([Upstream("plain", url)]), ProxySettings()), port=free_port())
    await proxy.start_server()
    figures = []
    try:
        async with aiohttp.ClientSession() as client:
            for i in range(5):
                system = {"role": "system", "content": f"You are a coding agent. Session {i}. " * 40}
                turn1 = [system, {"role": "user", "content": "Read main.py."}]
                turn2 = [
                    *turn1,
                    {"role": "assistant", "content": "It prints hello."},
                    {"role": "user", "content": "Fix it."},
                ]

                async def post(messages: list[dict[str, str]]) -> None:
                    body = {"model": "m", "stream": True, "max_tokens": 16, "messages": messages}
                    async with client.post(proxy.make_url("/v1/chat/completions"), json=body) as resp:
                        await resp.read()

                await post(turn1)
                await asyncio.sleep(0.05)  # the session's statistics update runs off the request path
                calls: list[str] = []
                profile = _profiler(calls)
                sys.setprofile(profile)
                try:
                    await post(turn2)
                finally:
                    sys.setprofile(None)
                figures.append(walk_rooms(calls))
    finally:
        await proxy.close()
        await fake.close()
    return figures


def walk_child() -> None:
    """In the child process: the walk's figures, as JSON on stdout."""
    import adaptive_spec

    runs = asyncio.run(_walk_once())
    sys.stdout.write(orjson.dumps({"source": adaptive_spec.__file__, "runs": runs}).decode() + "\n")


def walk(tree: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "src"), str(ROOT)])}
    code = "from benchmarks.house.measures import walk_child; walk_child()"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"the walk failed for {tree}:\n{out.stderr[-3000:]}")
    answer = orjson.loads(out.stdout.splitlines()[-1])
    if not Path(answer["source"]).is_relative_to(tree / "src"):  # an installed copy came first on the path
        raise SystemExit(f"the walk of {tree} imported {answer['source']}")
    runs = answer["runs"]
    return {
        "rooms": _median([r[0] for r in runs]),
        "returns": _median([r[1] for r in runs]),
        "steps": _median([r[2] for r in runs]),
    }


def _median(values: list[float]) -> float:
    found = percentile(values, 0.5)
    assert found is not None, "a walk of no request"
    return found


def measure(tree: Path) -> dict[str, Any]:
    return {**static(tree), "walk": walk(tree)}


def _row(name: str, m: dict[str, Any]) -> str:
    over = ", ".join(f"{f} {n}" for f, n in m["over_limit"].items()) or "none"
    longest = ", ".join(f"{mod.removeprefix(PACKAGE + '.')} {n}" for mod, n in m["longest"][:3])
    w, repeated = m["walk"], ", ".join(str(m["duplicates"][area]) for area in AREAS)
    return (
        f"| {name} | {m['modules']} in {m['folders']} | {over} | {longest} | {m['arrows']} ({m['package_arrows']} "
        f"between packages) | {len(m['circles'])} | {repeated} | {w['rooms']:.0f} / {w['returns']:.0f} / "
        f"{w['steps']:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", action="append", default=[], metavar="NAME=TREE", help="another tree to measure")
    parser.add_argument("--out", type=Path, default=RESULTS / "house.json")
    args = parser.parse_args()
    trees = {"this tree": ROOT}
    for spec in args.other:
        name, _, path = spec.partition("=")
        trees[name] = Path(path).resolve()
    results = {name: measure(tree) for name, tree in trees.items()}
    print(
        "| tree | modules in folders | folders over 12 | longest | arrows | circles | pairs repeating "
        f"{SAME_LINES} lines: {', '.join(AREAS)} | walk: rooms / returns / steps |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, m in results.items():
        print(_row(name, m))
    for name, m in results.items():
        for component in m["circles"]:
            print(f"{name}: circle {' ↔ '.join(component)}")
    write(args.out, "house.measures", results)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
