"""benchmarks/ by claim: every script the docs name exists, every runnable script is named in docs/benchmarks.md or
docs/gpu.md and opens with the line that runs it, no folder grows past twelve modules, and nothing edits `sys.path`
(benchmarks run as modules from the repository root)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BENCHMARKS = ROOT / "benchmarks"
DOCS = [ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "gpu.md"]
MENTIONS = [
    *DOCS,
    ROOT / "README.md",
    ROOT / "examples" / "README.md",
    ROOT / "Makefile",
    ROOT / "docs" / "architecture.md",
]
NAMED = re.compile(r"-m (benchmarks(?:\.\w+)+)|(?<![\w/])benchmarks/((?:\w+/)*\w+)\.py")


def _modules() -> dict[str, Path]:
    return {
        ".".join(p.relative_to(ROOT).with_suffix("").parts): p
        for p in BENCHMARKS.rglob("*.py")
        if "results" not in p.relative_to(BENCHMARKS).parts and p.name != "__init__.py"
    }


def _runnable(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(
        isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test)
        for node in tree.body
    )


def _named(paths: list[Path]) -> set[str]:
    names: set[str] = set()
    for path in paths:
        for module, file in NAMED.findall(path.read_text()):
            names.add(module or "benchmarks." + file.replace("/", "."))
    return names


def test_every_script_the_docs_name_exists() -> None:
    modules = _modules()
    missing = sorted(n for n in _named(MENTIONS) if n not in modules and n.removeprefix("benchmarks.") != "results")
    assert missing == [], f"named but not there: {missing}"


def test_every_runnable_script_is_named_in_the_benchmark_docs_and_opens_with_its_run_line() -> None:
    named = _named(DOCS)
    runnable = {name: path for name, path in _modules().items() if _runnable(path)}
    assert len(runnable) >= 20  # the claims' scripts, not an empty folder
    assert sorted(set(runnable) - named) == []
    for name, path in runnable.items():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert f"python -m {name}" in doc, f"{name}: its docstring says how to run it"


def test_helpers_are_not_scripts() -> None:
    helpers = [p for name, p in _modules().items() if name.startswith("benchmarks.harness.")]
    assert helpers and not any(_runnable(p) for p in helpers)


def test_no_folder_holds_more_than_twelve_modules() -> None:
    for folder in [BENCHMARKS, *(p for p in BENCHMARKS.iterdir() if p.is_dir())]:
        count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
        assert count <= 12, f"{folder.relative_to(ROOT)}: {count} modules"


def test_nothing_edits_sys_path() -> None:
    edits = re.compile(r"sys\.path\.(insert|append|extend)|sys\.path\s*[+]?=")
    offenders = [
        str(p.relative_to(ROOT))
        for folder in (BENCHMARKS, ROOT / "tests")
        for p in folder.rglob("*.py")
        if p != Path(__file__) and edits.search(p.read_text())
    ]
    assert offenders == []
