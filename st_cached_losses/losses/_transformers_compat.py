"""The one door to transformers' internals: what :class:`~st_cached_losses.CachedLossCallback` needs of a ``Trainer``
beyond its documented API, reached here alone, with the release range it was tested with.

- ``Trainer._get_output_dir(trial)`` (private method): the folder the trainer writes this run's
  ``checkpoint-<step>`` folders in (``args.output_dir``, or a trial's folder under a hyperparameter search), which is
  where the callback saves each memory bank beside the trainer's checkpoint. transformers has no public name for it:
  ``Trainer._save_checkpoint`` asks this method.

Only a loss with a memory bank needs it. :func:`check_trainer`, when the callback is attached (before training),
checks that the trainer has the name and that it behaves (outside a search, the folder is ``args.output_dir``): a
ValueError says which check failed, since the banks would then be saved where no resume finds them. A release outside
:data:`TESTED` whose trainer passes both checks is used, with one logged warning per process (a wrong folder shows up
in the checks, not silently). ``tests/test_transformers_compat.py`` checks each name's behaviour on the installed
transformers, the warning and the refusals.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

from ..gradcache.tested_range import TestedRange

__all__ = ["BORROWED", "TESTED", "check_trainer", "run_folder"]

logger = logging.getLogger(__name__)

# transformers releases whose Trainer was checked: 5.25.0 (CI: what the README's install resolves today), 5.24.0 (CI
# before it), 5.23.0 and 5.17.0 (the GPU machine's).
TESTED = ">=5.17,<5.26"
RANGE = TestedRange(TESTED)
BORROWED = ("_get_output_dir",)  # the private Trainer names used below


def check_trainer(trainer: Any, version: str | None = None) -> None:
    """Check that ``trainer`` has every name of :data:`BORROWED` and that ``_get_output_dir`` gives ``args.output_dir``
    outside a search; warn once per process when ``version`` (default: the installed transformers') is outside
    :data:`TESTED`.

    Raises:
        ValueError: a name is missing or gives another folder (naming the installed release and the fix).
    """
    version = version or importlib.import_module("transformers").__version__  # sys.modules' (replaced by imports)
    missing = [name for name in BORROWED if not callable(getattr(trainer, name, None))]
    if missing:
        _refuse(version, f"has no Trainer.{', Trainer.'.join(missing)}")
    folder, expected = run_folder(trainer, None), os.fspath(trainer.args.output_dir)
    if folder != expected:
        _refuse(version, f"gives {folder!r} for args.output_dir {expected!r}")
    RANGE.warn_outside(
        version,
        logger,
        "CachedLossCallback saves the memory bank beside the trainer's checkpoints through transformers' private "
        f"Trainer.{', Trainer.'.join(BORROWED)}, checked with transformers {{tested}}; the installed {{version}} has "
        "it and it gives the checkpoints' folder, so it is used.",
    )


def _refuse(version: str, why: str) -> None:
    raise ValueError(
        f"CachedLossCallback saves a memory bank beside the trainer's checkpoints through transformers' private "
        f"Trainer.{', Trainer.'.join(BORROWED)}, checked with transformers {TESTED}; the installed transformers "
        f"{version} {why}: pip install 'transformers{TESTED}', or train without a memory bank (memory_size=0)."
    )


def run_folder(trainer: Any, trial: Any) -> str:
    """The folder ``trainer`` writes this run's ``checkpoint-<step>`` folders in, as ``Trainer._save_checkpoint``
    finds it: ``args.output_dir``, or ``output_dir/run-<trial id>`` (``output_dir/<hp_name(trial)>`` with an
    ``hp_name``) under a hyperparameter search."""
    return os.fspath(trainer._get_output_dir(trial=trial))
