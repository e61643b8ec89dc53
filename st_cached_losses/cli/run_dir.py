"""The run directory: what a run of the main job writes into ``output_dir`` and how, so that nothing a user wrote
is ever deleted and the directory never holds a half-written run.

A run writes ``model/``, ``results.json`` and the run marker (:data:`RUN_OUTPUTS`) into a staging directory beside
``output_dir`` and moves them in at the end (:func:`publish`). The marker is how :func:`check_output_dir` tells a
previous run (replaced with ``overwrite``) from a directory of someone else's (always refused).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .usage import COMMAND, UsageError, quiet_loading

__all__ = ["RUN_MARKER", "RUN_OUTPUTS", "check_output_dir", "publish", "write_run"]

# What a run writes into output_dir, and all that overwrite replaces. The marker, written by the run itself,
# is how a directory is recognised as a previous run: anything else in the directory is never touched.
RUN_MARKER = ".st-cached-losses-run"
RUN_OUTPUTS = ("model", "results.json", RUN_MARKER)


def check_output_dir(path: Path, overwrite: bool) -> None:
    """Refuse an output dir that would clobber something.

    Raises:
        UsageError: ``path`` is a file; or a non-empty directory without the run marker (:data:`RUN_MARKER`:
            not a previous run, refused even with ``overwrite``); or a previous run and ``overwrite`` is False.
    """
    if path.exists() and not path.is_dir():
        raise UsageError(f"--output-dir {str(path)!r} is a file, not a directory")
    if not path.is_dir() or not any(path.iterdir()):
        return
    if not (path / RUN_MARKER).is_file():
        raise UsageError(
            f"--output-dir {str(path)!r} is not empty and holds no previous run of {COMMAND} (no "
            f"{RUN_MARKER} file); choose a new or empty directory"
        )
    if not overwrite:
        raise UsageError(
            f"--output-dir {str(path)!r} holds a previous run; pass --overwrite to replace its model/ and results.json"
        )


def write_run(output_dir: Path, model, results: dict[str, Any]) -> None:
    """Write ``model/``, ``results.json`` and the run marker into a staging dir next to ``output_dir``, then move
    them into place (:func:`publish`): ``output_dir`` holds either the previous state or the complete new run,
    never a half-written one, and nothing else in it is touched.

    Raises:
        OSError: a write or move failed (the staging dir is removed, ``output_dir`` is as it was).
    """
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.partial-", dir=output_dir.parent))
    try:
        with quiet_loading():
            model.save(str(staging / "model"))  # with its model card
        (staging / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        (staging / RUN_MARKER).write_text(
            f"Written by {COMMAND}; --overwrite replaces {', '.join(RUN_OUTPUTS)} and nothing else in this directory.\n"
        )
        publish(staging, output_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already unless something failed


def publish(staging: Path, target: Path) -> None:
    """Move the finished run (:data:`RUN_OUTPUTS`) from ``staging`` into ``target``.

    A new ``target`` is ``staging`` renamed. Into an existing one (empty, or a previous run) only the run's own
    outputs move, replacing the previous run's at the last moment; other files in ``target`` stay untouched.
    If a move fails, the previous outputs are put back.

    Raises:
        FileExistsError: ``target`` has gained a ``model`` or ``results.json`` of someone else's (no run marker)
            since the run was checked; nothing is moved.
    """
    if not target.exists():
        os.replace(staging, target)
        return
    if not (target / RUN_MARKER).is_file() and any(os.path.lexists(target / name) for name in RUN_OUTPUTS):
        raise FileExistsError(f"{target} gained files named like a run's outputs during the run; not replacing them")
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    moved_out, moved_in = [], []
    try:
        for name in RUN_OUTPUTS:
            if os.path.lexists(target / name):
                os.replace(target / name, old / name)
                moved_out.append(name)
        for name in RUN_OUTPUTS:
            os.replace(staging / name, target / name)
            moved_in.append(name)
    except BaseException:
        for name in moved_in:
            os.replace(target / name, staging / name)
        for name in moved_out:
            os.replace(old / name, target / name)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
