"""The one host synchronisation of an op call: :class:`HostRead`, and the two-phase call of a backend around it.

An op call reads on the host what only the host can decide with: the NaN policy's finiteness flags, the arguments'
device-side conditions (``core.call.run_op``'s ``conditions``: the positives present, ``query_ids`` agreeing with
``world_query_ids``) and the few small integers a backend needs there to size its work (MaxSim chunked: each tile's
count of scored query tokens, which it compacts; the dense Triton kernels: the width of their table of forbidden text
codes). All of them are computed on the device first and read by one
``tolist``: one synchronisation per call, however many tiles, ids or masks.

A backend module that needs such integers defines, besides ``forward(problem)``, ``prepare(problem, host)``: it
computes them on the device, asks ``host`` for them (:meth:`HostRead.ask`) and returns the call to run after the read,
which takes their values (``host[key]``). :func:`prepare_backend` is that first phase for any backend (a module
without ``prepare`` asks nothing), :func:`call_backend` both phases with a read of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .problem import Problem

__all__ = ["HostRead", "call_backend", "prepare_backend"]


class HostRead:
    """The values an op call reads on the host, read once (:meth:`read`).

    ``conditions``: (0-dim bool device tensor, message) pairs that must hold (a ValueError with the message where one
    does not). Before the read a backend asks for integers (:meth:`ask`); after it, ``host[key]`` is their list.
    """

    def __init__(self, conditions: Sequence[tuple[Tensor, str]] = ()):
        self.conditions = tuple(conditions)
        self._asked: dict[str, Tensor] = {}
        self._values: dict[str, list[int]] = {}

    def ask(self, key: str, ints: Tensor) -> None:
        """Read ``ints`` (an integer tensor of any shape, on the device of the call's other tensors) with the
        others; its values (flattened) are ``self[key]`` after :meth:`read`."""
        self._asked[key] = ints

    def __getitem__(self, key: str) -> list[int]:
        return self._values[key]

    def read(self, flags: Sequence[Tensor] = ()) -> list[bool]:
        """The values of ``flags`` (0-dim bool device tensors), read with the conditions and the asked integers by
        one ``tolist`` (nothing to read: no synchronisation).

        Raises:
            ValueError: the message of the first condition that does not hold.
        """
        bools = [*flags, *(condition for condition, _ in self.conditions)]
        parts = [torch.stack(bools).long()] if bools else []
        parts += [ints.reshape(-1).long() for ints in self._asked.values()]
        values = torch.cat(parts).tolist() if parts else []
        for (_, message), holds in zip(self.conditions, values[len(flags) : len(bools)]):
            if not holds:
                raise ValueError(message)
        start = len(bools)
        for key, ints in self._asked.items():
            self._values[key] = values[start : start + ints.numel()]
            start += ints.numel()
        return [bool(value) for value in values[: len(flags)]]


def prepare_backend(entry: Any, problem: Problem, host: HostRead) -> Callable[[], Any]:
    """The first phase of ``entry``'s (an ``ops.core.backend.Backend``) call on ``problem``: its module's
    ``prepare(problem, host)`` where it has one, else nothing to do. Returns the call to run once ``host`` has been
    read."""
    module = entry.load()
    prepare = getattr(module, "prepare", None)
    if prepare is None:
        return functools.partial(module.forward, problem)
    return prepare(problem, host)


def call_backend(entry: Any, problem: Problem) -> Any:
    """``entry``'s call on ``problem``, the integers it asks for read here (one synchronisation, if any)."""
    host = HostRead()
    run = prepare_backend(entry, problem, host)
    host.read()
    return run()
