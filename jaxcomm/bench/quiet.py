"""Whether the machine was quiet during a run: the CPU time others took from it.

A benchmark competes with whatever else runs on its machine: another job, a
process left spinning by an earlier run, the hypervisor's other guests. The
figures do not show it, so :class:`Watch` measures it beside them, per host,
from Linux's ``/proc/stat``:

- **other work**: the busy CPU time of the whole machine less the CPU time of
  the run's own processes on it (``getrusage``, every thread, kernel time
  spent for them included), as a number of cores kept busy on average;
- **steal**: the time the hypervisor ran something else on the machine's
  virtual CPUs, also in cores.

Off Linux (no ``/proc/stat``) nothing is measured and nothing is said.
"""

from __future__ import annotations

import os
import resource
import socket
import time
from typing import Any

from mpi4py import MPI

# Above this many cores of other work or steal a run is reported as not quiet.
QUIET_CORES = 0.1


def machine_cpu_seconds(stat: str = "/proc/stat") -> tuple[float, float] | None:
    """Busy and stolen CPU seconds of this machine since boot, over all its CPUs.

    None where ``stat`` cannot be read (not Linux).
    """
    try:
        with open(stat) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:9]] + [0] * 8
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks[:8]
    hz = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / hz, steal / hz


def own_cpu_seconds() -> float:
    """CPU seconds this process has used, every thread, user and kernel."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Watch:
    """Measures, from construction to :meth:`finish`, the CPU time others took.

    Every rank of ``comm`` makes and finishes it together (both are
    collective).

    Attributes:
        host: the ranks of ``comm`` on this host, until :meth:`finish`
            frees it; its rank 0 reads the machine's figures.
    """

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm
        self.host = comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.host.Barrier()
        self.own = own_cpu_seconds()
        self.machine = machine_cpu_seconds() if self.host.rank == 0 else None
        self.start = time.monotonic()

    def finish(self) -> dict[str, dict[str, float]]:
        """Per host name: ``other_cores`` and ``steal_cores``, averages over the run.

        Empty where ``/proc/stat`` could not be read.
        """
        own = self.host.allreduce(own_cpu_seconds() - self.own)
        self.host.Barrier()
        entry = None
        if self.host.rank == 0 and self.machine is not None:
            now = machine_cpu_seconds()
            wall = max(time.monotonic() - self.start, 1e-9)
            if now is not None:
                busy, steal = (b - a for a, b in zip(self.machine, now))
                entry = (
                    socket.gethostname(),
                    {
                        "other_cores": max(busy - own, 0.0) / wall,
                        "steal_cores": steal / wall,
                        "cpus": os.cpu_count() or 0,
                        "seconds": wall,
                    },
                )
        self.host.Free()
        return dict(e for e in self.comm.allgather(entry) if e is not None)


def lines(hosts: dict[str, dict[str, Any]]) -> list[str]:
    """One line per host on what else ran, marked NOT QUIET past :data:`QUIET_CORES`."""
    out = []
    for host, w in sorted(hosts.items()):
        busy = w["other_cores"] > QUIET_CORES or w["steal_cores"] > QUIET_CORES
        out.append(
            f"{'NOT QUIET' if busy else 'quiet'}: on {host} other processes kept "
            f"{w['other_cores']:.2f} of {w['cpus']} cores busy and the hypervisor took "
            f"{w['steal_cores']:.2f} cores over the {w['seconds']:.0f} s run"
            + ("; the figures competed with them" if busy else "")
        )
    return out
