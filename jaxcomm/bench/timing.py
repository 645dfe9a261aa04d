"""Timing: the one clock loop every benchmark uses, and the progress bar.

:func:`seconds` is how every figure of the package is taken (after a barrier
where the ranks must start together); :func:`median_seconds` is the median of
several such samples.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI


def seconds(call: Callable[[], Any], calls: int = 1, comm: MPI.Comm | None = None) -> float:
    """Wall seconds per call of ``calls`` calls of ``call()``, after a barrier on ``comm`` if given."""
    if comm is not None:
        comm.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def median_seconds(
    call: Callable[[], Any],
    repeats: int,
    comm: MPI.Comm,
    *,
    warmup: int = 1,
    barrier_each: bool = True,
) -> float:
    """Median of ``repeats`` samples of one ``call()`` each, this rank's.

    Args:
        call: one timed call; it returns once its work is complete.
        repeats: samples.
        comm: the ranks that start together.
        warmup: untimed calls first (compilation, first touches of memory).
        barrier_each: a barrier before every sample, rather than once before all.
    """
    for _ in range(warmup):
        call()
    if not barrier_each:
        comm.Barrier()
    samples = [seconds(call, comm=comm if barrier_each else None) for _ in range(repeats)]
    return float(np.median(samples))


# Process names (as Linux shortens them) of MPI launchers and their daemons.
_LAUNCHERS = ("mpiexec", "mpirun", "hydra_pmi_proxy", "prterun", "prted", "orterun", "orted")


def _stderr_is_terminal() -> bool:
    """Whether this process's stderr ends on a terminal.

    A launcher gives its ranks a pipe and copies it to its own stderr, so a
    rank's ``isatty()`` is always false under ``mpiexec``; on Linux, look at
    the launcher's stderr instead, walking up through its processes.
    """
    if sys.stderr.isatty():
        return True
    pid = os.getppid()
    try:
        for _ in range(4):
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
            if not name.startswith(_LAUNCHERS):
                return False
            if os.readlink(f"/proc/{pid}/fd/2").startswith(("/dev/pts/", "/dev/tty")):
                return True
            pid = int(rest.split()[1])
    except (OSError, ValueError):
        pass
    return False


class Progress:
    """A one-line progress bar on stderr (rank 0, a terminal, not disabled)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done = total, 0
        self.enabled = enabled and _stderr_is_terminal()
        self.start = time.perf_counter()

    def step(self, label: str) -> None:
        """Count one measurement done and redraw."""
        self.done += 1
        if not self.enabled:
            return
        width = 30
        filled = width * self.done // max(1, self.total)
        elapsed = time.perf_counter() - self.start
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
            f"{elapsed:5.0f}s {label:<32}"
        )
        sys.stderr.flush()

    def close(self) -> None:
        """End the bar's line."""
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
