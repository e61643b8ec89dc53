"""The one door to transformers' internals: what :class:`~st_cached_losses.CachedLossCallback` needs of a ``Trainer``
beyond its documented API, reached here alone, with the release range it was tested with.

- ``Trainer._get_output_dir(trial)`` (private method): the folder the trainer writes this run's
  ``checkpoint-<step>`` folders in (``args.output_dir``, or a trial's folder under a hyperparameter search), which is
  where the callback saves each memory bank beside the trainer's checkpoint. transformers has no public name for it:
  ``Trainer._save_checkpoint`` asks this method.

Only a loss with a memory bank needs it: :func:`check_trainer` raises a ValueError naming the installed release and
:data:`TESTED` when a name is missing or the release is outside that range, when the callback is attached (before
training). ``tests/test_transformers_compat.py`` checks each name's behaviour on the installed transformers and the
refusals.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from packaging.version import Version

__all__ = ["BORROWED", "TESTED", "check_trainer", "run_folder"]

TESTED = ">=5.17,<5.24"  # transformers releases whose Trainer was checked (5.23.0 in CI, 5.17.0 on the GPU machine)
_LOWEST, _BELOW = Version("5.17"), Version("5.24")
BORROWED = ("_get_output_dir",)  # the private Trainer names used below


def check_trainer(trainer: Any, version: str | None = None) -> None:
    """Raises ValueError unless ``version`` (default: the installed transformers') is in :data:`TESTED` and
    ``trainer`` has every name of :data:`BORROWED`."""
    version = version or importlib.import_module("transformers").__version__  # sys.modules' (replaced by imports)
    release = Version(Version(version).base_version)
    missing = [name for name in BORROWED if not callable(getattr(trainer, name, None))]
    outside = not _LOWEST <= release < _BELOW
    if missing or outside:
        why = ["is outside that range"] if outside else []
        why += [f"has no Trainer.{', Trainer.'.join(missing)}"] if missing else []
        raise ValueError(
            f"CachedLossCallback saves a memory bank beside the trainer's checkpoints through transformers' private "
            f"Trainer.{', Trainer.'.join(BORROWED)}, checked with transformers {TESTED}; the installed transformers "
            f"{version} {' and '.join(why)}: pip install 'transformers{TESTED}', or train without a memory bank "
            "(memory_size=0)."
        )


def run_folder(trainer: Any, trial: Any) -> str:
    """The folder ``trainer`` writes this run's ``checkpoint-<step>`` folders in, as ``Trainer._save_checkpoint``
    finds it: ``args.output_dir``, or ``output_dir/run-<trial id>`` (``output_dir/<hp_name(trial)>`` with an
    ``hp_name``) under a hyperparameter search."""
    return os.fspath(trainer._get_output_dir(trial=trial))
