"""The house's measures (benchmarks/house/measures.py) count what docs/module-map.md says they count."""

from __future__ import annotations

from pathlib import Path

from benchmarks.house.measures import circles, duplicates, folders, graph, package_arrows, walk_rooms


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_walk_counts_rooms_and_the_returns_into_rooms_left() -> None:
    # a a b a c b: steps a b a c b (a call within a room is no step), rooms a b c, returns a and b.
    assert walk_rooms(["a", "a", "b", "a", "c", "b"]) == (3, 2, 5)
    assert walk_rooms([]) == (0, 0, 0)


def test_circles_are_the_modules_that_reach_each_other() -> None:
    arrows = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert circles(arrows) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_arrows_follow_absolute_relative_and_from_imports(tmp_path: Path) -> None:
    tree = _tree(
        tmp_path,
        {
            "src/adaptive_spec/__init__.py": "",
            "src/adaptive_spec/x/__init__.py": "",
            "src/adaptive_spec/x/one.py": "from adaptive_spec.y import two\nfrom . import three\n",
            "src/adaptive_spec/x/three.py": "def f():\n    import adaptive_spec.y.two\n",
            "src/adaptive_spec/y/__init__.py": "",
            "src/adaptive_spec/y/two.py": "from adaptive_spec.x.one import thing\nimport os\n",
        },
    )
    arrows, lines = graph(tree)
    assert arrows["adaptive_spec.x.one"] == {
        "adaptive_spec.y",
        "adaptive_spec.y.two",
        "adaptive_spec.x",
        "adaptive_spec.x.three",
    }
    assert arrows["adaptive_spec.x.three"] == {"adaptive_spec.y.two"}
    assert arrows["adaptive_spec.y.two"] == {"adaptive_spec.x.one"}
    # one → three → two → one
    assert circles(arrows) == [["adaptive_spec.x.one", "adaptive_spec.x.three", "adaptive_spec.y.two"]]
    assert package_arrows(arrows) == 2  # x → y and y → x
    assert lines["adaptive_spec.y.two"] == 2


def test_a_folder_counts_its_modules_not_its_init(tmp_path: Path) -> None:
    tree = _tree(tmp_path, {"tests/__init__.py": "", "tests/a.py": "", "tests/b.py": "", "tests/sub/c.py": ""})
    assert folders(tree) == {"tests": 2, "tests/sub": 1}


def test_places_repeat_when_they_share_six_lines_a_longer_stretch_once(tmp_path: Path) -> None:
    shared = "".join(f"x{i} = call({i})\n" for i in range(9))  # nine lines: one pair, not four
    five = "".join(f"y{i} = call({i})\n" for i in range(5))
    tree = _tree(
        tmp_path,
        {
            "src/a.py": "import os\n" + shared + five,
            # The same stretch, spaced and commented otherwise: still the same lines.
            "src/b.py": "\n# a comment\n" + shared.replace("x3", "    x3").replace("x5 =", "\n\nx5 =") + "z = 1\n",
            "src/c.py": five + "w = 2\n",  # five lines shared with a.py: no pair
            "tests/t.py": shared,  # another area
        },
    )
    assert duplicates(tree, "src") == 1
    assert duplicates(tree, "tests") == 0
    same = _tree(tmp_path / "one", {"src/d.py": "".join("v = 1\n" for _ in range(8))})
    assert duplicates(same, "src") == 0  # a file's stretch does not pair with one overlapping it
    twice = _tree(tmp_path / "two", {"src/e.py": shared + "pass\n" + shared})
    assert duplicates(twice, "src") == 1
