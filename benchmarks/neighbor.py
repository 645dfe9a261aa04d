"""Neighbourhood exchange: one neighbour collective beside a loop of per-neighbour sendrecvs.

Run:  mpiexec -n 4 python -m benchmarks.neighbor [--sizes 8 4096 65536] [--repeats 7]

Each rank exchanges one block with each neighbour on a ring (the rank
before and after it; one neighbour on 2 ranks, itself on 1), the ghost or
halo exchange of a partitioned mesh, in a jitted ``fori_loop``:

- neighbor: ``JaxComm.from_graph(peers, peers).neighbor_alltoall(x)``, one
  ``MPI_Neighbor_alltoall`` per step (which jaxcomm makes one ``MPI_Sendrecv``
  where every rank has one neighbour, and point-to-point messages per edge
  for blocks up to 64 KiB);
- sendrecv loop: a Python loop of blocking ``JaxComm.sendrecv``, one per
  neighbour in ascending rank order, in the same jitted loop (how a
  finite-element code such as tatva does its ghost exchange).

Both results are checked equal first. Rank 0 prints microseconds per step
(medians of ``--repeats`` runs, the slowest rank's, the two loops taking
turns) for each block size per neighbour and the median of the runs' ratios
loop / neighbor (above 1: the neighbourhood collective is faster). On a
machine with fewer cores than ranks the figures mostly measure scheduling.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from jaxcomm import JaxComm
from jaxcomm.bench.timing import seconds

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


def paired(fs, x, repeats, comm):
    """Seconds of each ``f(x)`` of ``fs``, the slowest rank's, as ``repeats`` interleaved samples.

    The functions take turns, each run after a barrier, so that a busy
    machine's load falls on both alike; ratios are taken sample by sample.
    """
    calls = {name: (lambda f=f: jax.block_until_ready(f(x))) for name, f in fs.items()}
    for call in calls.values():
        call()
    samples = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            samples[name].append(comm.allreduce(seconds(call, comm=comm), op=MPI.MAX))
    return {name: np.asarray(t) for name, t in samples.items()}


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
            "   (us per exchange, medians, slowest rank; ratio: median of loop / neighbor)"
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
        samples = paired(
            {name: looped(step, iters) for name, step in steps.items()}, x, args.repeats, world
        )
        t = {name: float(np.median(v)) / iters for name, v in samples.items()}
        ratio = float(np.median(samples["sendrecv loop"] / samples["neighbor"]))
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
