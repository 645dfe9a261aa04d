"""Overlap: a large message and a computation of about its duration, blocking and nonblocking.

Run:  mpiexec -n 2 python -m benchmarks.overlap [--mib 16 64] [--repeats 7]

On a machine with few cores, give XLA one thread per rank and let MPI make
progress on its own (see docs/nonblocking.md):

    XLA_FLAGS=--xla_cpu_multi_thread_eigen=false MPICH_ASYNC_PROGRESS=1 \\
        mpiexec -n 2 python -m benchmarks.overlap

For each message size and each operation (a ring ``isend``/``irecv``,
``iallreduce``, and ``iragged_all_to_all`` of an equal share of the message
to every rank), every rank times, as medians of ``--repeats`` runs of one
jitted function each, after a barrier:

- message: the blocking operation alone (``sendrecv`` / ``allreduce`` /
  ``ragged_all_to_all``);
- compute: an XLA computation alone, a loop of small matrix products whose
  length is calibrated to take about as long as the message;
- blocking: the blocking operation and the computation, in one function
  (XLA may run the two at once on two threads: they are independent);
- nonblocking: start, the computation, wait, as written (XLA chooses the
  order, and may run the wait on another thread while the computation runs);
- during: start, ``jc.during(requests, computation)``, wait: the computation
  runs after the starts and before the waits, on the same thread.

It prints them with the ratios of the two nonblocking times to
max(compute, message), the target being 1.2 or less (1.0 is perfect
overlap, (compute + message) / max is none). Times are the slowest rank's.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from jaxcomm import JaxComm
from jaxcomm.bench.timing import median_seconds


def compute(steps):
    """A jittable computation of ``steps`` small matrix products, independent of any message."""

    def run(a):
        return jax.lax.fori_loop(0, steps, lambda i, m: jnp.tanh(m @ m) * 0.5, a)

    return run


def neighbours(jc):
    """The ring's (left, right): the rank that sends to this one, and the one it sends to."""
    return (jc.rank - 1) % jc.size, (jc.rank + 1) % jc.size


def shares(jc, x):
    """``ragged_all_to_all``'s arguments but the operand: x's rows in equal blocks, one per rank."""
    block = x.shape[0] // jc.size
    blocks = np.arange(jc.size, dtype=np.int32) * block
    sizes = np.full(jc.size, block, np.int32)
    return jnp.zeros_like(x), blocks, sizes, np.full(jc.size, jc.rank * block, np.int32), sizes


def message(jc, op):
    """The blocking operation ``op`` ("ring", "allreduce" or "ragged") on x."""
    if op == "ring":
        left, right = neighbours(jc)
        return lambda x: jc.sendrecv(x, x, source=left, dest=right)
    if op == "ragged":
        return lambda x: jc.ragged_all_to_all(x, *shares(jc, x))
    return jc.allreduce


def start(jc, op, x):
    """Start ``op`` on x; returns the requests, the receive (or result) first."""
    if op == "ring":
        left, right = neighbours(jc)
        return [jc.irecv(x, source=left), jc.isend(x, right)]
    if op == "ragged":
        return [jc.iragged_all_to_all(x, *shares(jc, x))]
    return [jc.iallreduce(x)]


def programs(jc, op, steps):
    """The four jitted functions of one row, each of (x, a) -> outputs."""
    work = compute(steps)
    blocking_op = message(jc, op)

    def alone(x, a):
        return blocking_op(x)

    def computing(x, a):
        return work(a)

    def blocking(x, a):
        return blocking_op(x), work(a)

    def nonblocking(x, a):
        requests = start(jc, op, x)
        c = work(a)
        return jc.waitall(requests)[0], c

    def during(x, a):
        requests = start(jc, op, x)
        c = jc.during(requests, work, a)
        return jc.waitall(requests)[0], c

    return {
        name: jax.jit(f)
        for name, f in (
            ("message", alone),
            ("compute", computing),
            ("blocking", blocking),
            ("nonblocking", nonblocking),
            ("during", during),
        )
    }


def timed(f, args, repeats, comm):
    """Median seconds of f(*args), the slowest rank's, each run after a barrier."""
    median = median_seconds(lambda: jax.block_until_ready(f(*args)), repeats, comm)
    return comm.allreduce(median, op=MPI.MAX)


def calibrate(target, a, repeats, comm):
    """Loop steps for a computation of about ``target`` seconds (the same on every rank)."""
    probe = 16
    per_step = timed(jax.jit(compute(probe)), (a,), repeats, comm) / probe
    return max(1, int(round(target / per_step)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--ops",
        nargs="+",
        default=["ring", "allreduce"],
        choices=["ring", "allreduce", "ragged"],
    )
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    jc = JaxComm(world)
    a = jnp.asarray(np.random.default_rng(jc.rank).standard_normal((192, 192)), jnp.float32)
    if jc.rank == 0:
        mpi = MPI.Get_library_version().splitlines()[0]
        print(f"# {jc.size} ranks, jax {jax.__version__}, {mpi}")
        print(
            f"# {'op':9} {'MiB':>4} {'message':>9} {'compute':>9} {'blocking':>9} "
            f"{'nonblock':>9} {'during':>9} {'max(c,m)':>9} {'ratio':>6} {'ratio':>6}"
            "   (ms, medians, slowest rank; ratios: nonblock/max, during/max)"
        )
    for mib in args.mib:
        x = jnp.full(mib * (1 << 20) // 4, float(jc.rank), jnp.float32)
        for op in args.ops:
            alone = timed(jax.jit(message(jc, op)), (x,), args.repeats, world)
            steps = calibrate(alone, a, args.repeats, world)
            t = {
                name: timed(f, (x, a), args.repeats, world)
                for name, f in programs(jc, op, steps).items()
            }
            best = max(t["compute"], t["message"])
            if jc.rank == 0:
                print(
                    f"  {op:9} {mib:>4} {1e3 * t['message']:9.1f} {1e3 * t['compute']:9.1f} "
                    f"{1e3 * t['blocking']:9.1f} {1e3 * t['nonblocking']:9.1f} "
                    f"{1e3 * t['during']:9.1f} {1e3 * best:9.1f} "
                    f"{t['nonblocking'] / best:6.2f} {t['during'] / best:6.2f}",
                    flush=True,
                )
    jc.free()


if __name__ == "__main__":
    main()
