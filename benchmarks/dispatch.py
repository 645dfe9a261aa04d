"""Per-call latency of small jaxcomm calls, side by side with references.

Run:  mpiexec -n 2 python benchmarks/dispatch.py [--calls N]

Rows, all on one float32 element so that dispatch, not bandwidth, dominates:
  jit(x + 1)          a jitted function with no MPI (JAX's fast path)
  mpi4py Allreduce    a NumPy buffer through mpi4py (MPI alone)
  jaxcomm jit         jax.jit(jc.allreduce)
  jaxcomm eager       jc.allreduce called eagerly
  mpi4jax jit         mpi4jax.allreduce under jit, when mpi4jax is installed
Rank 0 prints median microseconds per call and the ratio to mpi4py's.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from jaxcomm import JaxComm


def median_us(fn, calls, comm):
    for _ in range(20):
        fn()
    samples = []
    for _ in range(5):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return float(np.median(samples))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()

    world = MPI.COMM_WORLD
    jc = JaxComm(world)
    x = jnp.ones(1, jnp.float32)
    buf, out = np.ones(1, np.float32), np.empty(1, np.float32)

    plain = jax.jit(lambda v: v + 1)
    jitted = jax.jit(jc.allreduce)
    rows = [
        ("jit(x + 1)", lambda: plain(x).block_until_ready()),
        ("mpi4py Allreduce", lambda: world.Allreduce(buf, out)),
        ("jaxcomm jit", lambda: jitted(x).block_until_ready()),
        ("jaxcomm eager", lambda: jc.allreduce(x).block_until_ready()),
    ]
    try:
        import mpi4jax

        m4j = jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM, comm=world))
        rows.append(("mpi4jax jit", lambda: m4j(x).block_until_ready()))
    except ImportError:
        pass

    results = [(name, median_us(fn, args.calls, world)) for name, fn in rows]
    if world.rank == 0:
        reference = dict(results)["mpi4py Allreduce"]
        print(f"{world.size} ranks, jax {jax.__version__}, {args.calls} calls x 5 repeats")
        print(f"{'call':<20}{'us/call':>10}{'x mpi4py':>10}")
        for name, us in results:
            print(f"{name:<20}{us:>10.1f}{us / reference:>10.2f}")
    jc.free()


if __name__ == "__main__":
    main()
