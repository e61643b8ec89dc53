"""How the main job reports bad and doubtful input: :class:`UsageError` (one line, exit code 2, nothing written)
and :func:`warn` (one line, the run goes on); :func:`quiet_loading` keeps the loaders' own lines out of the way.
A module of its own so that the data, the main job and the command line can all import it without importing
each other."""

from __future__ import annotations

import contextlib
import sys

PROG = "st-cached-losses"
COMMAND = f"{PROG} train"


class UsageError(ValueError):
    """Bad input to the main job: reported as one line on stderr, exit code 2, nothing written."""


def warn(message: str) -> None:
    """A one-line warning on stderr (through ``tqdm.write``: never inside a progress bar): the run goes on."""
    import tqdm

    tqdm.tqdm.write(f"{COMMAND}: warning: {message}", file=sys.stderr)


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none, e.g. StopIteration), followed
    by that of its root cause in parentheses: "An error occurred while generating the dataset" says less."""
    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    lines = [str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__ for e in (error, root)]
    return lines[0] if root is error else f"{lines[0]} ({lines[1]})"


@contextlib.contextmanager
def quiet_loading():
    """Hide the loading/saving progress bars and log lines of transformers and datasets (restored on exit), so
    that a usage error is the only line on stderr; training keeps its own progress bar."""
    import datasets
    import datasets.utils.logging as datasets_logging
    import transformers.utils.logging as transformers_logging

    datasets_on, transformers_on = datasets.is_progress_bar_enabled(), transformers_logging.is_progress_bar_enabled()
    datasets_verbosity = datasets_logging.get_verbosity()
    datasets.disable_progress_bars()
    transformers_logging.disable_progress_bar()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)  # e.g. "Failed to load JSON from file ..."
    try:
        yield
    finally:
        datasets_logging.set_verbosity(datasets_verbosity)
        if datasets_on:
            datasets.enable_progress_bars()
        if transformers_on:
            transformers_logging.enable_progress_bar()
