"""2 gloo processes on CPU, each holding half of the batch: spawning them (the rendezvous store this process hosts, a
deadline to join them by) and setting each one up (one thread, the rendezvous environment, a process group whose
collectives time out soon).

A test runs ``spawn(worker, *args)``; each process runs ``worker(rank, port, *args)``, which calls ``child_setup``,
builds its models (before the process group: once it exists, transformers' save_pretrained, which the tiny models go
through, writes nothing on ranks other than 0), then ``init_process_group``. A failing process fails the test (its
traceback is re-raised), a hung one is killed."""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from st_cached_losses.testing import local_rank_setup, rendezvous_store
from tests.helpers import texts

WORLD_SIZE = 2
ROWS = 8  # the whole batch; ROWS // WORLD_SIZE per process
MINI_BATCH_SIZE = 3  # 4 local rows -> 2 embedding mini-batches per column
DIMS = [48, 32, 8]
JOIN_TIMEOUT_S = 300  # failure guard only: every spawned test finishes well under this
PROCESS_GROUP_TIMEOUT_S = 120  # a collective that waits longer has hung (a rank failed or took another path)


def local_rows(rank: int) -> slice:
    """The rows of the whole batch that process ``rank`` holds."""
    return slice(rank * ROWS // WORLD_SIZE, (rank + 1) * ROWS // WORLD_SIZE)


def batch_texts(negatives: int, seed: int = 11) -> list[list[str]]:
    """The whole batch's texts: [anchors, positives, ``negatives`` hard-negative columns], ROWS each."""
    return [texts(ROWS, seed + 100 * column) for column in range(2 + negatives)]


def spawn(fn, *args) -> None:
    """Run ``fn(rank, port, *args)`` in WORLD_SIZE spawned processes (``port``: the rendezvous store's, which this
    process hosts until they are done); re-raise a child's failure, kill them all after JOIN_TIMEOUT_S."""
    with rendezvous_store() as port:
        context = mp.start_processes(fn, args=(port, *args), nprocs=WORLD_SIZE, join=False, start_method="spawn")
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        try:
            # join raises (and terminates the others) as soon as one child fails; True once all exited cleanly.
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} did not finish within {JOIN_TIMEOUT_S} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join(5)


def child_setup(rank: int, port: int) -> None:
    """One thread, and the environment torch.distributed and the trainer read (offline, no tokenizer threads)."""
    local_rank_setup(rank, WORLD_SIZE, port)


def init_process_group(rank: int, timeout_s: float = PROCESS_GROUP_TIMEOUT_S) -> None:
    """The gloo process group of the WORLD_SIZE processes (after ``child_setup``)."""
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=timeout_s))


class CountGathers:
    """Counts torch.distributed's all-gathers while inside (what gathering the batch, the ids or the masks calls)."""

    def __enter__(self):
        self.count, self.original = 0, dist.all_gather

        def counting(*args, **kwargs):
            self.count += 1
            return self.original(*args, **kwargs)

        dist.all_gather = counting
        return self

    def __exit__(self, *exc):
        dist.all_gather = self.original
