"""The built-in dataset: code search over the installed Python standard library, no download.

Each pair is (anchor = the first paragraph of a public function's, class's or method's docstring, positive = its
qualified name and signature), e.g.::

    anchor:   "Return True if x is a positive or negative infinity, and False otherwise."
    positive: "math.isinf(x, /)"

``--dataset stdlib-dups`` keeps what ``stdlib`` drops as ambiguous: a docstring shared by several objects (aliases
such as ``os.path.getsize``'s, "Close the file." on many classes) gives one query several positives, and a repeated
signature one positive several queries; only exact repeats of a pair are dropped. Its batches hold real duplicates
for ``--mask-duplicates`` (a query's other positives are false negatives of each other).

The pairs are extracted at run time (well under a second, nothing is cached on disk) from the modules
listed in ``sys.stdlib_module_names`` and their submodules. The extraction is deterministic for a given Python
installation: modules are visited in sorted order, only objects *defined* in a module are taken (re-exports are
skipped), and installed third-party packages play no part. Train and test are split by top-level module
(``email.*`` lands entirely on one side) with a stable hash of the module name, so the test split holds libraries
the model never saw in training.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import pkgutil
import sys
import warnings
import zlib
from collections import Counter
from collections.abc import Iterator
from types import ModuleType

import datasets

__all__ = [
    "SKIPPED_MODULES",
    "deduplicate",
    "distinct_pairs",
    "load_stdlib_dataset",
    "split_of",
    "stdlib_modules",
    "stdlib_pairs",
]

# Top-level modules left out: importing them has side effects (opens a browser, prints, starts Tk or
# writes grammar caches), they are shims that third-party packages replace (distutils), or they are
# hundreds of near-identical codec modules (encodings) or terminal hooks (readline).
SKIPPED_MODULES = frozenset(
    {
        "antigravity",
        "distutils",
        "encodings",
        "ensurepip",
        "idlelib",
        "lib2to3",
        "pydoc_data",
        "readline",
        "rlcompleter",
        "this",
        "tkinter",
        "turtle",
        "turtledemo",
        "venv",
    }
)
# A submodule whose dotted name has one of these parts is a test suite or private.
_SKIPPED_PARTS = frozenset({"test", "tests", "idle_test"})


def _is_public_module(name: str) -> bool:
    parts = name.split(".")
    return parts[0] not in SKIPPED_MODULES and not any(p.startswith("_") or p in _SKIPPED_PARTS for p in parts)


def _quiet_import(name: str) -> ModuleType | None:
    """Import ``name`` with warnings and output silenced; ``None`` if it cannot be imported here.

    Platform-specific modules (winreg, msvcrt, ...) and ones whose C extension is missing fail on some
    installations; they are simply skipped, which is the only way the module list depends on the machine.
    """
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except (Exception, SystemExit):
        return None  # KeyboardInterrupt (Ctrl-C) is not caught


def stdlib_modules() -> Iterator[ModuleType]:
    """Yield the importable public standard-library modules and their public submodules, sorted by name."""
    for top in sorted(sys.stdlib_module_names):
        if not _is_public_module(top) or (module := _quiet_import(top)) is None:
            continue
        yield module
        if hasattr(module, "__path__"):  # a package: visit its submodules, depth first, in sorted order
            subnames = [
                info.name
                for info in pkgutil.walk_packages(module.__path__, prefix=f"{top}.", onerror=lambda _: None)
                if _is_public_module(info.name)
            ]
            for name in sorted(subnames):
                if (submodule := _quiet_import(name)) is not None:
                    yield submodule


def _first_paragraph(obj: object) -> str | None:
    """The first prose paragraph of ``obj``'s own docstring on one line, or ``None`` if it has none.

    ``obj.__doc__`` rather than ``inspect.getdoc``: the latter inherits a parent's docstring, which would
    give every override the same query. Paragraphs that are a signature line (C functions without a text
    signature start with ``name(...)``) or a doctest are skipped: they would leak the answer.
    """
    doc = getattr(obj, "__doc__", None)
    if not isinstance(doc, str):
        return None
    name = getattr(obj, "__name__", "")
    for paragraph in inspect.cleandoc(doc).split("\n\n"):
        text = " ".join(paragraph.split())
        if not text or text.startswith(">>>") or (name and text.startswith(f"{name}(")):
            continue
        return text if len(text.split()) >= 3 else None
    return None


class _Elided:
    """A default value shown as ``...``: its repr would carry a memory address or the environment."""

    def __repr__(self) -> str:
        return "..."


_LITERAL_TYPES = (type(None), bool, int, float, complex, str, bytes)


def _is_literal(value: object) -> bool:
    if isinstance(value, (tuple, frozenset)):
        return all(_is_literal(item) for item in value)
    return type(value) in _LITERAL_TYPES and len(repr(value)) <= 40


def _signature(obj: object) -> str | None:
    """``obj``'s signature as written in code, e.g. ``(path, mode='r', *, timeout=...)``; ``None`` if unknown.

    Annotations are dropped and non-literal defaults (sentinels, functions, ``os.environ``) become ``...``, so
    the text is the same in every process.
    """
    try:
        signature = inspect.signature(obj)
    except Exception:
        return None
    parameters = [
        p.replace(
            annotation=inspect.Parameter.empty,
            default=p.default if p.default is p.empty or _is_literal(p.default) else _Elided(),
        )
        for p in signature.parameters.values()
    ]
    return str(signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty))


def _pair(obj: object, qualname: str, module: str) -> dict[str, str] | None:
    anchor, signature = _first_paragraph(obj), _signature(obj)
    if anchor is None or signature is None:
        return None
    return {"anchor": anchor, "positive": f"{qualname}{signature}", "module": module}


def _defined_in(obj: object, module: ModuleType, unknown: bool = False) -> bool:
    """Whether ``obj`` was defined in ``module`` (``unknown`` if it does not say, as C methods do not).

    A C accelerator counts as the module itself: ``functools.reduce.__module__ == "_functools"``. Objects
    from elsewhere are re-exports, or monkey-patches by third-party packages (transformers adds methods
    to ``logging.Logger``), and must not make the data depend on what is installed.
    """
    owner = getattr(obj, "__module__", None)
    return unknown if owner is None else owner in (module.__name__, f"_{module.__name__}")


def _module_pairs(module: ModuleType) -> Iterator[dict[str, str]]:
    """Pairs for the public functions and classes defined in ``module`` and their public methods."""
    # Importing a submodule rebinds the package attribute of the same name (curses.has_key, the C function,
    # becomes the module curses.has_key), so such names are skipped: the pairs must not depend on what was
    # imported before.
    submodules = {info.name for info in pkgutil.iter_modules(getattr(module, "__path__", []))}
    for name, obj in sorted(vars(module).items()):
        if module is sys:  # sys keeps the originals of its replaceable hooks (pytest sets unraisablehook)
            obj = getattr(sys, f"__{name}__", obj)
        if name.startswith("_") or name in submodules or not _defined_in(obj, module):
            continue
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        qualname = f"{module.__name__}.{name}"
        if (pair := _pair(obj, qualname, module.__name__)) is not None:
            yield pair
        if inspect.isclass(obj):
            for method_name in sorted(vars(obj)):  # own methods only; getattr unwraps static/class methods
                method = getattr(obj, method_name, None)
                public = not method_name.startswith("_") and inspect.isroutine(method)
                if public and _defined_in(method, module, True):
                    pair = _pair(method, f"{qualname}.{method_name}", module.__name__)
                    if pair is not None:
                        yield pair


def stdlib_pairs(keep_duplicates: bool = False) -> list[dict[str, str]]:
    """All (anchor, positive, module) pairs of the installed standard library, de-duplicated.

    Args:
        keep_duplicates: keep the pairs that share an anchor or a positive (:func:`distinct_pairs`) instead of
            dropping them (:func:`deduplicate`).

    Returns:
        A list of dicts with keys ``anchor`` (docstring paragraph), ``positive`` (``qualname(signature)``)
        and ``module`` (dotted module name), in module order. A docstring paragraph shared by several
        objects ("Close the file.") is ambiguous as a query, so every pair that has it is dropped, unless
        ``keep_duplicates``.
    """
    with warnings.catch_warnings():  # reading deprecated attributes (typing.re) warns
        warnings.simplefilter("ignore")
        pairs = [pair for module in stdlib_modules() for pair in _module_pairs(module)]
    return distinct_pairs(pairs) if keep_duplicates else deduplicate(pairs)


def distinct_pairs(pairs: list[dict[str, str]]) -> list[dict[str, str]]:
    """Drop exact repeats of an (anchor, positive) pair (keeping the first); the order is kept."""
    seen: set[tuple[str, str]] = set()
    return [pair for pair in pairs if (key := (pair["anchor"], pair["positive"])) not in seen and not seen.add(key)]


def deduplicate(pairs: list[dict[str, str]]) -> list[dict[str, str]]:
    """Drop every pair whose anchor (case-folded) occurs more than once, then repeated positives (keeping the
    first); the order is kept."""
    counts = Counter(pair["anchor"].casefold() for pair in pairs)
    seen_positives: set[str] = set()
    unique = []
    for pair in pairs:
        if counts[pair["anchor"].casefold()] == 1 and pair["positive"] not in seen_positives:
            seen_positives.add(pair["positive"])
            unique.append(pair)
    return unique


def split_of(module: str, test_fraction: float = 0.2) -> str:
    """``"test"`` or ``"train"`` for a dotted module name, decided by a stable hash of its top-level package.

    CRC-32 rather than ``hash()``: the latter is salted per process (PYTHONHASHSEED).
    """
    top = module.split(".")[0]
    return "test" if zlib.crc32(top.encode()) % 1000 < test_fraction * 1000 else "train"


def load_stdlib_dataset(test_fraction: float = 0.2, keep_duplicates: bool = False) -> datasets.DatasetDict:
    """The built-in code-search dataset as ``{"train": Dataset, "test": Dataset}``.

    Args:
        test_fraction: the share of top-level modules (not of pairs) that go to the test split, in [0, 1].
        keep_duplicates: the ``stdlib-dups`` variant (see :func:`stdlib_pairs`).

    Returns:
        A ``datasets.DatasetDict`` whose splits have the string columns ``anchor``, ``positive`` and
        ``module``; a few thousand rows in all (the count depends on the Python version).

    Raises:
        ValueError: if ``test_fraction`` is outside [0, 1].
    """
    if not 0.0 <= test_fraction <= 1.0:
        raise ValueError(f"test_fraction must be in [0, 1], got {test_fraction}")
    rows: dict[str, list[dict[str, str]]] = {"train": [], "test": []}
    for pair in stdlib_pairs(keep_duplicates):
        rows[split_of(pair["module"], test_fraction)].append(pair)
    features = datasets.Features({key: datasets.Value("string") for key in ("anchor", "positive", "module")})
    return datasets.DatasetDict(
        {split: datasets.Dataset.from_list(items, features=features) for split, items in rows.items()}
    )
