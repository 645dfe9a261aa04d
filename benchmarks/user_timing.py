"""What a user's stopwatch sees: whole jitted or eager calls, timed around ``block_until_ready``.

    MPI4PY_RC_THREAD_LEVEL=<level> mpiexec -n 2 python -m benchmarks.user_timing \
        [--parts thread,eager,ring] [--rounds 15]

Every figure is the median over ``--rounds`` interleaved rounds (each round
times every variant of a part once, in turn) of the slowest rank's
``time.perf_counter`` around the calls and ``block_until_ready``; no
differencing. Three parts:

- ``thread``: 8-byte allreduces in a loop, per iteration: a C loop
  (``jaxcomm.bench``'s C floor, in this process, so at the thread level MPI
  was initialised with) and one jitted ``fori_loop`` of jaxcomm allreduces.
  Below ``MPI_THREAD_SERIALIZED`` jaxcomm refuses to run and only the C loop
  is timed.
- ``eager``: one 8-byte allreduce per call: eager ``jc.allreduce``, the same
  call jitted, and a plain jitted function with the same output.
- ``ring``: 50 ring sendrecvs of 1 and 4 MiB of float32, each result halved
  into the next input: one jitted ``fori_loop`` against mpi4py's
  ``Sendrecv`` and ``np.multiply`` on preallocated arrays.

The header says whether the launcher bound the ranks to cores: unbound, each
rank's XLA sizes its thread pool to every core of the machine and splits a
large elementwise step over it (``docs/benchmarks.md``), which the ring's
switches column shows.

Run it with ``-m`` from the repository root (the benchmarks package keeps
the source tree's jaxcomm, which has no compiled kernels, off the path) or
from outside the source tree.
"""

import argparse
import os
import resource
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import jaxcomm
from jaxcomm.bench.routes.c_floor import load_floor

LEVELS = {
    MPI.THREAD_SINGLE: "single",
    MPI.THREAD_FUNNELED: "funneled",
    MPI.THREAD_SERIALIZED: "serialized",
    MPI.THREAD_MULTIPLE: "multiple",
}


def _switches():
    """Context switches so far of every thread of this process (voluntary and not)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_nvcsw + usage.ru_nivcsw


def _slowest(comm, run):
    """The slowest rank's wall and CPU seconds and context switches for ``run()``, started together.

    CPU time is the process's (every thread's): on a loaded machine it leaves
    out the time a rank waited for a core, which wall time includes. Context
    switches count each time one of the process's threads went to sleep or
    was preempted: a thread handing work to another and waiting for it shows
    there.
    """
    comm.Barrier()
    wall, cpu, switches = time.perf_counter(), time.process_time(), _switches()
    run()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    switches = _switches() - switches
    return tuple(comm.allreduce(v, op=MPI.MAX) for v in (wall, cpu, switches))


def _interleaved(comm, variants, rounds, per):
    """Median wall and CPU seconds per unit of each variant over interleaved rounds.

    Args:
        comm: the communicator the times are maxed over.
        variants: name -> callable running ``per`` units and blocking on them.
        rounds: rounds, each timing every variant once.
        per: the units one callable runs (iterations or calls).

    Returns:
        name -> (median wall seconds, median CPU seconds, median context switches) per unit.
    """
    for run in variants.values():  # compile and warm up
        run()
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            times[name].append(_slowest(comm, run))
    return {
        name: tuple(statistics.median(t[k] for t in values) / per for k in range(3))
        for name, values in times.items()
    }


def _report(title, medians, unit, reference):
    if MPI.COMM_WORLD.Get_rank():
        return
    label = "us" if unit == 1e6 else "ms"
    print(
        f"\n{title}\n  {'':<34} {'wall ' + label:>10} {'ratio':>7}  {'CPU ' + label:>10} {'ratio':>7}"
        f"  {'switches':>9}"
    )
    base = medians.get(reference)
    for name, times in medians.items():
        cells = [
            f"{t * unit:10.3f} {t / b if b else 0:6.2f}x"
            for t, b in zip(times[:2], base[:2] if base else (0, 0))
        ]
        print(f"  {name:<34} {'  '.join(cells)}  {times[2]:9.2f}")
    print(f"  (ratios to {reference}; switches: the process's context switches, as wall and CPU)")


def _binding(comm):
    """How this job's ranks may use the cores: one line for the report."""
    cpus = comm.allgather(sorted(os.sched_getaffinity(0)))
    widest = max(map(len, cpus))
    if widest == os.cpu_count():
        return f"ranks unbound (each may run on all {widest} CPUs)"
    return f"ranks bound to {widest} CPU{'s' if widest > 1 else ''} each"


def thread_part(jc, comm, rounds, iters):
    """8-byte allreduces in a loop: the C floor and jaxcomm's jitted fori_loop, per iteration."""
    lib, why = load_floor(comm)
    variants = {}
    if lib is not None:
        floor_comm = comm.Dup()
        send = np.ones(2, np.float32)
        recv = np.zeros(2, np.float32)

        def c_loop():
            # jaxcomm_floor's loop halves each result into the next input, as the jitted one does.
            lib.jaxcomm_floor(
                floor_comm.py2f(), b"allreduce", 1, send.ctypes.data, 2, recv.ctypes.data, 2, iters
            )
            send[:] = 1

        variants["C loop"] = c_loop
    elif comm.Get_rank() == 0:
        print(f"no C floor: {why}")
    if jc is not None:

        @jax.jit
        def loop(x):
            return jax.lax.fori_loop(0, iters, lambda i, c: jc.allreduce(c) * 0.5, x)

        x = jnp.ones(2, jnp.float32)
        variants["jaxcomm jitted fori_loop"] = lambda: loop(x).block_until_ready()
    medians = _interleaved(comm, variants, rounds, iters)
    _report(f"8 B allreduce in a loop, per iteration ({iters} per call)", medians, 1e6, "C loop")


def eager_part(jc, comm, rounds, calls):
    """One 8-byte allreduce per call: eager, jitted, and a plain jitted function."""
    x = jnp.ones(2, jnp.float32)
    size = comm.Get_size()
    jitted = jax.jit(jc.allreduce)
    plain = jax.jit(lambda x: x * size)

    def repeat(f):
        def run():
            for _ in range(calls):
                f(x).block_until_ready()

        return run

    medians = _interleaved(
        comm,
        {
            "plain jitted x * size": repeat(plain),
            "jitted jc.allreduce": repeat(jitted),
            "eager jc.allreduce": repeat(jc.allreduce),
        },
        rounds,
        calls,
    )
    _report("8 B allreduce, whole call", medians, 1e6, "plain jitted x * size")


def ring_part(jc, comm, rounds, nbytes, steps=50):
    """50 ring sendrecvs, each result halved into the next input: jaxcomm against mpi4py."""
    rank, size = comm.Get_rank(), comm.Get_size()
    left, right = (rank - 1) % size, (rank + 1) % size
    n = nbytes // 4

    @jax.jit
    def ring(x):
        return jax.lax.fori_loop(
            0, steps, lambda i, c: jc.sendrecv(c, c, source=left, dest=right) * 0.5, x
        )

    x = jnp.ones(n, jnp.float32)
    a = np.ones(n, np.float32)
    b = np.empty_like(a)
    ref_comm = comm.Dup()

    def mpi4py_ring():
        for _ in range(steps):
            ref_comm.Sendrecv(a, right, 0, b, left, 0)
            np.multiply(b, 0.5, out=a)

    medians = _interleaved(
        comm,
        {"mpi4py": mpi4py_ring, "jaxcomm jitted fori_loop": lambda: ring(x).block_until_ready()},
        rounds,
        1,
    )
    _report(f"ring sendrecv x {steps}, {nbytes >> 20} MiB, whole call", medians, 1e3, "mpi4py")


def main(argv=None) -> int:
    """Time the parts asked for and print the medians and ratios on rank 0.

    Args:
        argv: command-line arguments (``sys.argv[1:]`` when None).

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="thread,eager,ring")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=20000, help="allreduces per thread-part loop")
    parser.add_argument("--calls", type=int, default=200, help="calls per eager-part round")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    level = MPI.Query_thread()
    runs = level >= MPI.THREAD_SERIALIZED
    jc = jaxcomm.JaxComm(comm) if runs else None
    binding = _binding(comm)
    if comm.Get_rank() == 0:
        print(
            f"{comm.Get_size()} ranks, {binding}, MPI_THREAD_{LEVELS[level].upper()}, jaxcomm "
            f"{jaxcomm.__version__} at {jaxcomm.__file__}, jax {jax.__version__}, "
            f"{MPI.Get_library_version().splitlines()[0]}; load average "
            + " ".join(open("/proc/loadavg").read().split()[:3])
        )
    parts = args.parts.split(",")
    if "thread" in parts:
        thread_part(jc, comm, args.rounds, args.iters)
    if runs and "eager" in parts:
        eager_part(jc, comm, args.rounds, args.calls)
    if runs and "ring" in parts:
        for nbytes in (1 << 20, 4 << 20):
            ring_part(jc, comm, args.rounds, nbytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
