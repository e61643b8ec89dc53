"""The package's layering, read from its source (every import statement, module level or inside a function):
no import circle; the library (losses, gradcache, ops) never imports the command line; gradcache never imports the
losses; ops never imports sentence-transformers; the losses never import triton (the op chooses its backend);
sentence-transformers' and DeepSpeed's internals each come through one module. The benchmarks' (``benchmarks/``): no
import circle, no module importing another's private (underscore) name, and the shared core (``benchmarks/core/``)
never importing a suite; ``ops/`` defines none of the benchmarks' code. And the tests': a test module shares code
through the helper modules only, never by importing another test module; only the benchmarks' tests
(``tests/benchmarks/``) import ``benchmarks``.

Module length, package and benchmarks alike: modules are split by meaning, not by length, so a module over 400 lines
is a warning (:class:`LongModuleWarning`, naming them) for a look at whether it holds two things; one over 800 lines
fails, so that nothing balloons."""

from __future__ import annotations

import ast
import contextlib
import re
import textwrap
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "st_cached_losses"
BENCHMARKS = PACKAGE.parent / "benchmarks"
TESTS = Path(__file__).resolve().parent
LIBRARY = ("st_cached_losses.losses", "st_cached_losses.gradcache", "st_cached_losses.ops")
ST_COMPAT = "st_cached_losses.gradcache._st_compat"
DEEPSPEED_COMPAT = "st_cached_losses.gradcache._deepspeed_compat"
FSDP_COMPAT = "st_cached_losses.gradcache._fsdp_compat"
FSDP_INTERNALS = ("_get_fsdp_state", "_fsdp_param_groups", "_auto_reshard_after_forward")
DEEPSPEED_INTERNALS = ("_backward_epilogue", "inside_no_sync_ctxt")
LONG_LINES = 400  # over this: a warning
MAX_LINES = 800  # over this: a failure


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute (``from . import x`` gives the package's ``x`` when it is a module)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _ancestor(package: str, name: str) -> bool:
    return name.startswith(package + ".")


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``modules`` it imports. A module's own ancestor packages are left out: importing any
    submodule runs its parents' __init__ first, so that edge holds for every module and closes no circle of its own
    making."""
    return {
        name: {m for m in _imports(path) if m in modules and m != name and not _ancestor(m, name)}
        for name, path in modules.items()
    }


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
GRAPH = _graph(MODULES)
BENCHMARK_MODULES = {_module_name(path): path for path in sorted(BENCHMARKS.rglob("*.py"))}
BENCHMARK_GRAPH = _graph(BENCHMARK_MODULES)


def _within(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Depth-first search over module-to-module imports (a package's ``__init__`` counts as a module)."""
    state: dict[str, str] = {}
    circles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[name] = "done"

    for name in graph:
        if name not in state:
            visit(name, [name])
    return circles


@pytest.mark.parametrize("graph", [GRAPH, BENCHMARK_GRAPH], ids=["package", "benchmarks"])
def test_the_import_graph_has_no_circle(graph):
    assert not _circles(graph)


def test_the_circle_search_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_the_library_never_imports_the_command_line():
    offenders = {
        name: sorted(m for m in GRAPH[name] if _within(m, ["st_cached_losses.cli"]))
        for name in GRAPH
        if _within(name, LIBRARY)
    }
    assert not {name: found for name, found in offenders.items() if found}


def test_gradcache_never_imports_the_losses():
    """The shared machinery sits below the losses that use it: the calls go down, never back up."""
    offenders = {
        name: sorted(m for m in GRAPH[name] if _within(m, ["st_cached_losses.losses"]))
        for name in GRAPH
        if _within(name, ["st_cached_losses.gradcache"])
    }
    assert not {name: found for name, found in offenders.items() if found}


def test_the_losses_never_import_triton():
    offenders = [
        name
        for name, path in MODULES.items()
        if _within(name, ["st_cached_losses.losses"])
        and any(m.split(".")[0] == "triton" or _within(m, ["st_cached_losses.ops.triton"]) for m in _imports(path))
    ]
    assert not offenders


def test_deepspeed_internals_come_through_one_module():
    """DeepSpeed's private engine attributes are named in ``gradcache/_deepspeed_compat.py`` alone, with its tested
    range."""
    offenders = [
        name
        for name, path in MODULES.items()
        if name != DEEPSPEED_COMPAT and any(internal in path.read_text() for internal in DEEPSPEED_INTERNALS)
    ]
    assert not offenders
    assert all(internal in MODULES[DEEPSPEED_COMPAT].read_text() for internal in DEEPSPEED_INTERNALS)


def test_fsdp2_internals_come_through_one_module():
    """FSDP2's private state is named in ``gradcache/_fsdp_compat.py`` alone, with its tested torch range."""
    offenders = [
        name
        for name, path in MODULES.items()
        if name != FSDP_COMPAT and any(internal in path.read_text() for internal in FSDP_INTERNALS)
    ]
    assert not offenders
    assert all(internal in MODULES[FSDP_COMPAT].read_text() for internal in FSDP_INTERNALS)


def test_ops_never_imports_sentence_transformers():
    offenders = [
        name
        for name, path in MODULES.items()
        if _within(name, ["st_cached_losses.ops"])
        and any(m.split(".")[0] == "sentence_transformers" for m in _imports(path))
    ]
    assert not offenders


def test_sentence_transformers_internals_come_through_one_module():
    """Private names (a leading underscore) and the internal modules the losses borrow from are imported in
    ``gradcache/_st_compat.py`` alone."""
    internal = re.compile(r"^sentence_transformers\.(base\.losses\.gradcache|sentence_transformer\.losses\.[a-z_]+)\b")
    offenders = {}
    for name, path in MODULES.items():
        if name == ST_COMPAT:
            continue
        borrowed = [
            m
            for m in _imports(path)
            if m.startswith("sentence_transformers")
            and (internal.match(m) or any(part.startswith("_") for part in m.split(".")))
        ]
        if borrowed:
            offenders[name] = borrowed
    assert not offenders


class LongModuleWarning(UserWarning):
    """Modules over ``LONG_LINES`` lines: worth a look at whether each holds one thing, not an error."""


def _lengths() -> dict[str, int]:
    modules = {**MODULES, **BENCHMARK_MODULES}
    return {name: len(path.read_text().splitlines()) for name, path in modules.items()}


def _long(lengths: dict[str, int], limit: int) -> dict[str, int]:
    return {name: n for name, n in sorted(lengths.items()) if n > limit}


def test_no_module_over_800_lines_and_long_ones_warn():
    lengths = _lengths()
    assert not _long(lengths, MAX_LINES)
    if long := _long(lengths, LONG_LINES):
        listed = ", ".join(f"{name} ({n})" for name, n in long.items())
        warnings.warn(f"modules over {LONG_LINES} lines: {listed}", LongModuleWarning, stacklevel=1)


def test_the_length_check_warns_over_400_and_fails_over_800():
    lengths = {"a": LONG_LINES, "b": LONG_LINES + 1, "c": MAX_LINES + 1}
    assert _long(lengths, LONG_LINES) == {"b": LONG_LINES + 1, "c": MAX_LINES + 1}
    assert _long(lengths, MAX_LINES) == {"c": MAX_LINES + 1}


def _private_names_borrowed(own: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """Private (one leading underscore) names module ``own`` (at ``path``) takes from another module of ``modules``:
    imported by name
    (``from benchmarks.x import _y``, ``import benchmarks._x``) or read as an attribute of an imported module
    (``from benchmarks import x`` then ``x._y``)."""
    private = lambda name: name.startswith("_") and not name.startswith("__")  # noqa: E731
    aliases, found = {}, []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.name != own:
                    found += [alias.name] if any(map(private, alias.name.split("."))) else []
                    aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == BENCHMARKS.name:
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                if target in modules:
                    aliases[alias.asname or alias.name] = target
                if node.module != own and (private(alias.name) or any(map(private, node.module.split(".")))):
                    found.append(target)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and private(node.attr):
            base = node.value.id if isinstance(node.value, ast.Name) else None
            if base in aliases and aliases[base] != own:
                found.append(f"{aliases[base]}.{node.attr}")
    return found


def test_benchmark_modules_take_no_private_name_of_another():
    offenders = {
        name: borrowed
        for name, path in BENCHMARK_MODULES.items()
        if (borrowed := _private_names_borrowed(name, path, BENCHMARK_MODULES))
    }
    assert not offenders


def test_the_private_name_check_sees_both_ways_of_borrowing(tmp_path):
    source = tmp_path / "benchmarks" / "suite.py"
    source.parent.mkdir()
    source.write_text("from benchmarks.core.timing import _mark\nfrom benchmarks import gpu\ngpu._bench()\n")
    modules = {"benchmarks.core.timing": source, "benchmarks.gpu": source}
    assert _private_names_borrowed("benchmarks.suite", source, modules) == [
        "benchmarks.core.timing._mark",
        "benchmarks.gpu._bench",
    ]


def test_the_benchmarks_core_imports_no_suite():
    """``benchmarks/core/`` is what the suites share: it imports no module outside it (the package aside)."""
    offenders = {
        name: sorted(m for m in targets if not _within(m, ["benchmarks.core"]))
        for name, targets in BENCHMARK_GRAPH.items()
        if _within(name, ["benchmarks.core"])
    }
    assert not {name: found for name, found in offenders.items() if found}


def _test_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every import in a file of tests/ from tests/ (``from tests.m import name``, ``from .m import
    name``, ``from tests import m``, ``import tests.m``), module level or inside a function; name "" for a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name.split(".")[0] == TESTS.name]
        elif isinstance(node, ast.ImportFrom):
            module = ".".join(filter(None, [TESTS.name if node.level else None, node.module]))
            if module == TESTS.name:  # from tests import m: the module m
                found += [(f"{module}.{alias.name}", "") for alias in node.names]
            elif module.split(".")[0] == TESTS.name:
                found += [(module, alias.name) for alias in node.names]
    return found


def test_test_modules_share_code_through_the_helpers_only():
    """What two test modules share lives in a helper module (tests/helpers.py, distributed_helpers.py, stock.py,
    duplicates_reference.py) or in conftest.py, under a public name: no file in tests/ imports a test_*.py module, or
    a private name from any module of tests/."""
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        for module, name in _test_imports(path):
            if module.split(".")[-1].startswith("test_") or name.startswith("_"):
                offenders.append(f"{path.name}: {module}" + (f".{name}" if name else ""))
    assert not offenders, offenders


def _benchmark_imports(source: str, scripts: bool = True) -> list[str]:
    """Every module of ``benchmarks`` that ``source`` imports, module level or inside a function, and (``scripts``) in
    the code of its string constants that parse as Python (the scripts a test runs in a fresh interpreter)."""
    trees = [ast.parse(source)]
    if scripts:
        for node in ast.walk(trees[0]):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "benchmarks" in node.value:
                with contextlib.suppress(SyntaxError):  # prose
                    trees.append(ast.parse(textwrap.dedent(node.value)))
    found = []
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [alias.name for alias in node.names if alias.name.split(".")[0] == BENCHMARKS.name]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found += [node.module] if node.module.split(".")[0] == BENCHMARKS.name else []
    return found


def test_only_the_benchmarks_tests_import_benchmarks():
    """The library's tests (all of tests/ but tests/benchmarks/, whose subject is a benchmark script or tool) import
    nothing from ``benchmarks/``: a check of the library stands without them. This file's strings are the checks'
    own fixtures, not scripts."""
    offenders = {
        str(path.relative_to(TESTS)): found
        for path in sorted(TESTS.rglob("*.py"))
        if not path.is_relative_to(TESTS / "benchmarks")
        and (found := _benchmark_imports(path.read_text(), scripts=path != Path(__file__).resolve()))
    }
    assert not offenders


def test_the_benchmark_import_check_sees_imports_in_functions_and_scripts():
    script = '"""\n    import benchmarks.core\n"""'
    source = f"def test():\n    from benchmarks.gpu import kernels\n    run({script})\n"
    assert _benchmark_imports(source) == ["benchmarks.gpu", "benchmarks.core"]
    assert _benchmark_imports("import benchmarksx\nfrom st_cached_losses import benchmarks\n") == []


BENCHMARK_ONLY = ("kernel_specs", "kernel_variants", "KernelSpec")  # the compile report's: benchmarks/gpu/specs.py


def _defined(path: Path) -> set[str]:
    """Names a module defines at its top level: functions, classes, assignments."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def test_ops_defines_no_benchmark_only_code():
    """The compile report's kernel descriptions live in ``benchmarks/gpu/specs.py``, not in ``ops/``."""
    offenders = {
        name: sorted(found)
        for name, path in MODULES.items()
        if _within(name, ["st_cached_losses.ops"]) and (found := _defined(path) & set(BENCHMARK_ONLY))
    }
    assert not offenders
    assert set(BENCHMARK_ONLY) <= _defined(BENCHMARKS / "gpu" / "specs.py")
