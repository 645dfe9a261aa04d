"""Neighbourhood exchange: one neighbour collective beside a loop of per-neighbour sendrecvs.

Run:  mpiexec -n 4 python -m jaxcomm.bench.neighbor [--sizes 8 4096 65536] [--repeats 7]

Each rank exchanges one block with each neighbour on a ring (the rank
before and after it; one neighbour on 2 ranks, itself on 1), the ghost or
halo exchange of a partitioned mesh, in a jitted ``fori_loop``:

- neighbor: ``JaxComm.from_graph(peers, peers).neighbor_alltoall(x)``, one
  ``MPI_Neighbor_alltoall`` per step;
- sendrecv loop: a Python loop of blocking ``JaxComm.sendrecv``, one per
  neighbour in ascending rank order, in the same jitted loop (how a
  finite-element code such as tatva does its ghost exchange).

Both results are checked equal first. Rank 0 prints microseconds per step
(medians of ``--repeats`` runs, the slowest rank's) for each block size per
neighbour and the ratio loop / neighbor (above 1: the neighbourhood
collective is faster).
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from ..comm import JaxComm
from .timing import median_seconds

DEFAULT_SIZES = (8, 64, 512, 4096, 32768, 262144, 1 << 20)


def peers(rank, size):
    """The ring neighbours of ``rank``, ascending, each once."""
    return sorted({(rank - 1) % size, (rank + 1) % size})


def exchanges(jc, mesh, neighbours):
    """``{name: step}``, each step mapping the blocks ``(degree, n)`` to the blocks received."""

    def sendrecv_loop(x):
        return jnp.stack(
            [jc.sendrecv(x[j], x[j], source=p, dest=p) for j, p in enumerate(neighbours)]
        )

    return {"neighbor": mesh.neighbor_alltoall, "sendrecv loop": sendrecv_loop}


def looped(step, iters):
    """A jitted loop of ``iters`` exchanges, each of the halved previous result."""

    def run(x):
        return jax.lax.fori_loop(0, iters, lambda i, c: step(c) * 0.5, x)

    return jax.jit(run)


def timed(f, x, repeats, comm):
    """Median seconds of ``f(x)``, the slowest rank's, each run after a barrier."""
    median = median_seconds(lambda: jax.block_until_ready(f(x)), repeats, comm)
    return comm.allreduce(median, op=MPI.MAX)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--iters", type=int, default=200, help="exchanges per timed loop, at most")
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    jc = JaxComm(world)
    neighbours = peers(jc.rank, jc.size)
    mesh = JaxComm.from_graph(neighbours, neighbours)
    steps = exchanges(jc, mesh, neighbours)
    if jc.rank == 0:
        mpi = MPI.Get_library_version().splitlines()[0]
        print(f"# {jc.size} ranks, {len(neighbours)} neighbours each, jax {jax.__version__}, {mpi}")
        print(
            f"# {'bytes/nbr':>10} {'neighbor':>10} {'sendrecv loop':>14} {'ratio':>6}"
            "   (us per exchange, medians, slowest rank; ratio: loop / neighbor)"
        )
    ratios = []
    for nbytes in args.sizes:
        n = max(1, nbytes // 4)
        x = jnp.asarray(
            np.arange(len(neighbours) * n, dtype=np.float32).reshape(len(neighbours), n)
            + 1000 * jc.rank
        )
        results = [np.asarray(jax.jit(step)(x)) for step in steps.values()]
        np.testing.assert_array_equal(results[0], results[1])
        # About 64 MiB through each loop at most, so large blocks stay quick.
        iters = max(4, min(args.iters, (64 << 20) // max(1, nbytes * len(neighbours))))
        t = {
            name: timed(looped(step, iters), x, args.repeats, world) / iters
            for name, step in steps.items()
        }
        ratio = t["sendrecv loop"] / t["neighbor"]
        ratios.append(ratio)
        if jc.rank == 0:
            print(
                f"  {nbytes:>10} {1e6 * t['neighbor']:10.2f} {1e6 * t['sendrecv loop']:14.2f} "
                f"{ratio:6.2f}",
                flush=True,
            )
    if jc.rank == 0:
        print(f"# neighbor faster at every size: {all(r > 1 for r in ratios)}")
    mesh.free()
    jc.free()


if __name__ == "__main__":
    main()
