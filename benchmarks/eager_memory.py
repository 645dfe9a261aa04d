"""Resident memory over thousands of eager jaxcomm calls.

Run:  mpiexec -n 2 python -m benchmarks.eager_memory [--calls N]

Each round makes one eager allreduce, bcast, sendrecv (with an MPI.Status)
and barrier. Rank 0 prints resident memory after a warm-up and after every
quarter of the rounds; a leak shows as steady growth.
"""

import argparse

import jax.numpy as jnp
from mpi4py import MPI

from jaxcomm import JaxComm

from .memory import rss_mib


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    jc = JaxComm(MPI.COMM_WORLD)
    right, left = (jc.rank + 1) % jc.size, (jc.rank - 1) % jc.size
    x = jnp.ones(1000)
    status = MPI.Status()

    def round_():
        jc.allreduce(x)
        jc.bcast(x, root=0)
        jc.sendrecv(x, x, source=left, dest=right, status=status)
        jc.barrier()

    for _ in range(200):
        round_()
    marks = [(0, rss_mib())]
    for i in range(1, args.calls + 1):
        round_()
        if i % (args.calls // 4) == 0:
            marks.append((i, rss_mib()))
    if jc.rank == 0:
        print(f"{jc.size} ranks, rounds of 4 eager calls after 200 warm-up rounds")
        for rounds, mib in marks:
            print(f"after {rounds:>6} rounds: {mib:8.1f} MiB (+{mib - marks[0][1]:.1f})")
    jc.free()


if __name__ == "__main__":
    main()
