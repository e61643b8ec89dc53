"""docs/design.md's module map ("Layout") against the tree, both ways.

The map is one table per root, under a heading that names the root in backticks (``### `st_cached_losses/` ``); each
row's first cell is one path in backticks, relative to that root: a module (``ops/core/bands.py``) or a package folder
(``ops/maxsim/``, standing for its ``__init__.py``). Every ``*.py`` under a root except ``__init__.py`` and every
package folder below a root must have a row, and every row must name one that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
DESIGN = REPOSITORY / "docs" / "design.md"
ROOTS = ("st_cached_losses/", "benchmarks/")
# A root's heading, and a table row whose first cell is one backticked path.
HEADING = re.compile(r"^### `([^`]+/)`\s*$")
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|")


def parse_map(text: str) -> dict[str, set[str]]:
    """Root -> the paths its table names, read from the "## Layout" section of ``text`` (to the next "## ")."""
    entries: dict[str, set[str]] = {}
    root = None
    in_layout = False
    for line in text.splitlines():
        if line.startswith("## "):
            in_layout = line.strip() == "## Layout"
            root = None
        elif in_layout and (heading := HEADING.match(line)):
            root = heading.group(1)
            entries.setdefault(root, set())
        elif in_layout and root and (row := ROW.match(line)):
            entries[root].add(row.group(1))
    return entries


def tree_entries(root: Path) -> set[str]:
    """What a root's table must name: every module but ``__init__.py``, and every package folder below the root."""
    modules = {p.relative_to(root).as_posix() for p in root.rglob("*.py") if p.name != "__init__.py"}
    folders = {p.parent.relative_to(root).as_posix() + "/" for p in root.rglob("__init__.py") if p.parent != root}
    return modules | folders


def differences(entries: set[str], root: Path) -> tuple[list[str], list[str]]:
    """(modules and folders missing from the map, rows naming nothing that exists)."""
    expected = tree_entries(root)
    return sorted(expected - entries), sorted(entries - expected)


MAP = parse_map(DESIGN.read_text())


def test_the_map_has_a_table_for_each_root():
    assert set(MAP) == set(ROOTS)


@pytest.mark.parametrize("root", ROOTS)
def test_the_map_agrees_with_the_tree(root):
    missing, stale = differences(MAP[root], REPOSITORY / root)
    assert not missing, f"docs/design.md's Layout has no row for {missing} under {root}"
    assert not stale, f"docs/design.md's Layout names {stale} under {root}, which do not exist"


SAMPLE = """## Layout

### `pkg/`

| module | what |
|---|---|
| `a.py` | one |
| `sub/` | a folder |
| `sub/b.py` | two |

## Next

| `ignored.py` | after the section |
"""


def _sample_tree(tmp_path: Path) -> Path:
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    for name in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py"):
        (root / name).write_text("")
    return root


def test_the_parser_reads_a_sample(tmp_path):
    root = _sample_tree(tmp_path)
    assert parse_map(SAMPLE) == {"pkg/": {"a.py", "sub/", "sub/b.py"}}
    assert differences(parse_map(SAMPLE)["pkg/"], root) == ([], [])


def test_a_module_without_a_row_is_found(tmp_path):
    root = _sample_tree(tmp_path)
    (root / "sub" / "c.py").write_text("")
    assert differences(parse_map(SAMPLE)["pkg/"], root) == (["sub/c.py"], [])


def test_a_row_naming_nothing_is_found(tmp_path):
    root = _sample_tree(tmp_path)
    (root / "a.py").unlink()
    text = SAMPLE.replace("| `a.py` | one |", "| `a.py` | one |\n| `gone/` | a folder that is not there |")
    assert differences(parse_map(text)["pkg/"], root) == ([], ["a.py", "gone/"])
