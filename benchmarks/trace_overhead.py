"""What the timeline recorder costs: an 8-byte allreduce in a jitted loop, recorder off and on.

    mpiexec -n 2 python -m benchmarks.trace_overhead [--calls 20000] [--rounds 5]

Each round times one jitted call of a ``fori_loop`` of ``--calls``
allreduces of 8 bytes with the recorder off, then on (``jaxcomm.trace`` to a
temporary directory), and prints the time per allreduce: the best round and
the median of each, and on minus off. A jaxcomm without the recorder (an
older build, for the cost of the switch itself) is timed off only, with the
same output, so two installs compare line by line. Run it from outside the
source tree, or with ``-m`` from the repository root (the benchmarks
package), with the installed jaxcomm.
"""

import argparse
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from mpi4py import MPI

import jaxcomm


def _time_loop(run, x, comm):
    comm.Barrier()
    start = time.perf_counter()
    run(x).block_until_ready()
    elapsed = time.perf_counter() - start
    # The slowest rank's time: the loop ends when every rank's calls did.
    return comm.allreduce(elapsed, op=MPI.MAX)


def main(argv=None) -> int:
    """Time the loop with the recorder off and on and print ns per call (rank 0).

    Args:
        argv: the arguments (default: the command line's).

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20000, help="allreduces per jitted call")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each off then on")
    args = parser.parse_args(argv)

    comm = MPI.COMM_WORLD
    jc = jaxcomm.JaxComm(comm)
    x = jnp.ones(2, jnp.float32)  # 8 bytes
    run = jax.jit(lambda x: jax.lax.fori_loop(0, args.calls, lambda i, y: jc.allreduce(y) * 0.5, x))
    run(x).block_until_ready()
    has_recorder = callable(getattr(jaxcomm, "trace", None))
    modes = ["off", "on"] if has_recorder else ["off"]
    times = {mode: [] for mode in modes}
    directory = comm.bcast(tempfile.mkdtemp(prefix="trace-overhead-") if comm.rank == 0 else None)
    for _ in range(args.rounds):
        for mode in modes:
            if mode == "on":
                with jaxcomm.trace(directory):
                    times[mode].append(_time_loop(run, x, comm))
            else:
                times[mode].append(_time_loop(run, x, comm))
    if comm.rank == 0:
        per_call = {m: [t / args.calls * 1e9 for t in ts] for m, ts in times.items()}
        label = "jaxcomm with recorder" if has_recorder else "jaxcomm without recorder"
        sys.stdout.write(f"{label}, {comm.size} ranks, {args.calls} x 8 B allreduce per loop\n")
        for mode, ns in per_call.items():
            sys.stdout.write(
                f"  recorder {mode:3}: best {min(ns):8.1f} ns/call, median {statistics.median(ns):8.1f}\n"
            )
        if has_recorder:
            best = min(per_call["on"]) - min(per_call["off"])
            median = statistics.median(per_call["on"]) - statistics.median(per_call["off"])
            sys.stdout.write(f"  on - off: best {best:+.1f} ns/call, median {median:+.1f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
