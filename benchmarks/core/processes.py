"""Run Python commands in fresh processes, a few at a time, and collect the JSON each prints last.

For measurements that need a process of their own (peak resident set size, a first step without warm caches):
the benchmarks run one such process per (contender, batch size).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

POLL_SECONDS = 0.2


def run_json_processes(commands: Sequence[Sequence[str]], jobs: int = 1, cwd: str | Path | None = None) -> list[dict]:
    """Run each command (``[sys.executable, "-m", ...]``), at most ``jobs`` at a time, in the order given (so with
    ``jobs >= len(commands)`` they all start together), with ``cwd`` first on PYTHONPATH.

    Returns:
        One dict per command, in order: the JSON object of its last line of stdout, or ``{"exit_code": n}`` when it
        failed (e.g. -9, killed for memory; its stderr's tail is printed and the others go on).
    """
    env = dict(os.environ)
    if cwd is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(cwd), os.environ.get("PYTHONPATH")]))
    results: list[dict | None] = [None] * len(commands)
    running: dict[int, subprocess.Popen] = {}
    pending = list(enumerate(commands))
    while pending or running:
        while pending and len(running) < max(1, jobs):
            index, command = pending.pop(0)
            running[index] = subprocess.Popen(
                list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env
            )
        done = next((i for i, process in running.items() if process.poll() is not None), None)
        if done is None:
            time.sleep(POLL_SECONDS)
            continue
        process = running.pop(done)
        stdout, stderr = process.communicate()
        if process.returncode != 0:
            print(
                f"{' '.join(commands[done])} failed ({process.returncode}):\n{stderr[-2000:]}",
                file=sys.stderr,
                flush=True,
            )
            results[done] = {"exit_code": process.returncode}
        else:
            results[done] = json.loads(stdout.strip().splitlines()[-1])
    return results
