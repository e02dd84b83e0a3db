"""Every package of the tree says what it owns and the rules its code honours, in a design note beside its code."""

from __future__ import annotations

from pathlib import Path

import adaptive_spec

ROOT = Path(adaptive_spec.__file__).resolve().parent


def test_every_top_level_package_has_a_design_note_that_says_what_it_owns_and_its_rules() -> None:
    packages = sorted(p for p in ROOT.iterdir() if p.is_dir() and any(p.glob("*.py")))
    assert packages
    for package in packages:
        note = package / "design.md"
        assert note.is_file(), f"{package.name}/ has no design.md"
        text = note.read_text(encoding="utf-8")
        assert "**Owns**" in text and "**Rules**" in text, f"{package.name}/design.md lacks what it owns or its rules"
        # A module it names is one that exists (a note that outlived a rename misleads).
        for name in {w.strip("`") for w in text.split() if w.startswith("`") and w.rstrip("`,.;):").endswith(".py")}:
            name = name.rstrip("`,.;):")
            assert (package / name).is_file() or (ROOT / name).is_file(), f"{package.name}/design.md names {name}"


def test_the_unit_tests_mirror_the_packages() -> None:
    """tests/unit/<package>/… holds the tests of src/adaptive_spec/<package>/…: a folder there names a package here;
    tests/unit/benchmarks/… those of the repository's benchmarks/ package. The tests left at the top span packages
    (the surfaces, the request path's cost, these notes)."""
    tests = Path(__file__).resolve().parent
    folders = [p for p in tests.rglob("*") if p.is_dir() and p.name != "__pycache__"]
    assert folders
    for folder in folders:
        rel = folder.relative_to(tests)
        package = (ROOT.parents[1] if rel.parts[0] == "benchmarks" else ROOT) / rel
        assert (package / "__init__.py").is_file(), f"tests/unit/{rel} names no package"
    top = sorted(p.name for p in tests.glob("test_*.py"))
    assert top == ["test_design_notes.py", "test_request_path_cost.py", "test_surfaces.py"]


def test_the_architecture_map_lists_every_module_once_by_its_own_summary() -> None:
    """docs/architecture.md's map: a line per module, saying what the module's docstring opens with."""
    import ast
    import re

    text = (ROOT.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    listed = re.findall(r"^- `([\w/]+\.py)` — (.*)$", text, flags=re.M)
    names = [name for name, _ in listed]
    assert len(names) == len(set(names)), "a module listed twice"
    modules = {
        p.relative_to(ROOT).as_posix()
        for p in ROOT.rglob("*.py")
        if p.parent != ROOT
        and not (p.name == "__init__.py" and p.parent.parent == ROOT)
        and ast.get_docstring(ast.parse(p.read_text(encoding="utf-8")))
    }
    assert set(names) == modules, (sorted(modules - set(names)), sorted(set(names) - modules))
    for name, summary in listed:
        doc = " ".join((ast.get_docstring(ast.parse((ROOT / name).read_text(encoding="utf-8"))) or "").split())
        assert doc.startswith(summary), f"{name}: the map says {summary[:60]!r}, its docstring opens otherwise"


def test_every_module_docstring_opens_with_one_summary_sentence() -> None:
    """A module's docstring opens with a paragraph of one sentence (what the map shows); the detail follows it."""
    import ast
    import re

    openings = []
    for path in sorted(ROOT.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        if doc:
            openings.append((path.relative_to(ROOT).as_posix(), " ".join(doc.split("\n\n")[0].split())))
    assert len(openings) > 100
    # A sentence ends at . ? or ! before a capital, a backtick or a bracket ("e.g." and "i.e." end none).
    more = [name for name, first in openings if re.search(r"(?<!e\.g)(?<!i\.e)[.!?]\s+[A-Z`(]", first)]
    unended = [name for name, first in openings if not first.endswith((".", "?", "!"))]
    assert not more, f"docstrings whose opening paragraph holds more than one sentence: {more}"
    assert not unended, f"docstrings whose opening paragraph does not end a sentence: {unended}"
