"""The ops' families (``ops/dense/``, ``ops/maxsim/``, ``ops/sparse/``) import from ``ops/core/`` and
``ops/candidates/`` only, never from each other (docs/design.md "Extending": how to add a family), read from every
import statement of their modules, module level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

OPS = Path(__file__).resolve().parents[1] / "st_cached_losses" / "ops"
FAMILIES = ("dense", "maxsim", "sparse")


def _imported_families(path: Path, family: str) -> set[str]:
    """The other families ``path`` (a module of ``family``) imports, relative or absolute."""
    found = set()
    depth = len(path.relative_to(OPS).parts) - 1  # 1 for ops/<family>/module.py
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolved against ops/<family>/...
                parts = ["st_cached_losses", "ops", *path.relative_to(OPS).parts[:-1]]
                parts = parts[: len(parts) - node.level + 1]
                module = ".".join([*parts, module] if module else parts)
            names = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["st_cached_losses", "ops"] and len(parts) > 2 and parts[2] in FAMILIES:
                found.add(parts[2])
    del depth
    return found - {family}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_never_imports_another(family):
    modules = sorted((OPS / family).rglob("*.py"))
    assert modules
    offenders = {str(p.relative_to(OPS)): sorted(_imported_families(p, family)) for p in modules}
    assert not {name: found for name, found in offenders.items() if found}


def test_the_check_sees_a_relative_import_of_another_family(tmp_path, monkeypatch):
    module = OPS / "sparse" / "op.py"
    source = "from ..dense.op import matryoshka_infonce\n\ndef f():\n    from st_cached_losses.ops.maxsim import spec\n"
    monkeypatch.setattr(Path, "read_text", lambda self: source)
    assert _imported_families(module, "sparse") == {"dense", "maxsim"}
