"""The release range a version door (``_transformers_compat.py``, ``_fsdp_compat.py``, ``_deepspeed_compat.py``) was
tested with, and its one warning per process for a release outside it (the door still checks each borrowed name at run
time)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from packaging.specifiers import SpecifierSet
from packaging.version import Version

__all__ = ["TestedRange"]


@dataclass
class TestedRange:
    """``spec`` (e.g. ">=5.17,<5.25"): the releases a door was tested with; pre-, post- and local releases count as
    their base release (``2.13.0+cu130`` is 2.13.0, ``5.24.0.dev0`` is 5.24.0)."""

    spec: str
    warned: set[str] = field(default_factory=set)  # the releases outside it already warned of in this process

    def __contains__(self, version: str) -> bool:
        return Version(Version(version).base_version) in SpecifierSet(self.spec)

    def warn_outside(self, version: str, logger: logging.Logger, message: str) -> None:
        """Log ``message`` (formatted with ``version`` and ``spec``) once per process per release outside the range."""
        if version not in self and version not in self.warned:
            self.warned.add(version)
            logger.warning(message.format(version=version, tested=self.spec))
