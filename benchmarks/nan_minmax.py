"""What NaN-propagating MIN/MAX cost: jaxcomm's own MPI op against MPI's predefined one.

Run:  mpiexec -n 2 python -m benchmarks.nan_minmax [--repeats N]

jaxcomm reduces float MIN and MAX with its own commutative MPI ops, which
propagate NaN like jnp.maximum; MPI's predefined MPI_MAX does not (MPICH's
keeps whichever operand comes first). For each dtype and size, the same
mpi4py MPI_Allreduce of a NumPy buffer runs with both ops, interleaved round by
round so that both see the same machine load, then jax.jit(jc.allreduce)
with MPI.MAX, which is what users call. MPI_Reduce_local with each op times
the combining alone, without communication. Rank 0 prints median microseconds
per call and the ratios of jaxcomm's op to MPI's.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from jaxcomm import JaxComm, _kernels_cpu
from jaxcomm.bench.timing import seconds
from jaxcomm.ops._base import REDUCTION_OPS

SIZES = (1, 1_000, 10_000, 100_000, 1_000_000, 10_000_000)
MAX = [name for name, _ in REDUCTION_OPS].index("MAX")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    world = MPI.COMM_WORLD
    jc = JaxComm(world)
    if world.rank == 0:
        print(f"{world.size} ranks; median us per call, MAX")
        print(
            f"{'':>19} {'--------- MPI_Allreduce ---------':>33} "
            f"{'------- MPI_Reduce_local -------':>33}"
        )
        print(
            f"{'dtype':>8} {'elements':>10} {'MPI_MAX':>10} {'jaxcomm op':>11} {'ratio':>10} "
            f"{'MPI_MAX':>10} {'jaxcomm op':>11} {'ratio':>10} {'jit(jc.allreduce)':>18}"
        )
    for dtype in (np.float32, np.float64):
        user_op = MPI.Op.f2py(_kernels_cpu.reduce_op(MAX, np.dtype(dtype).name))
        jitted = jax.jit(lambda v: jc.allreduce(v, op=MPI.MAX))
        for n in SIZES:
            buf = np.random.default_rng(world.rank).standard_normal(n).astype(dtype)
            out = np.empty_like(buf)
            x = jnp.asarray(buf)
            calls = max(3, min(2000, 20_000_000 // (n * 20)))
            rows = {
                "predefined": lambda: world.Allreduce(buf, out, op=MPI.MAX),
                "user": lambda: world.Allreduce(buf, out, op=user_op),
                "local predefined": lambda: MPI.MAX.Reduce_local(buf, out),
                "local user": lambda: user_op.Reduce_local(buf, out),
                "jit": lambda: jitted(x).block_until_ready(),
            }
            samples = {k: [] for k in rows}
            for fn in rows.values():
                fn()
            for _ in range(args.repeats):
                for key, fn in rows.items():
                    samples[key].append(seconds(fn, calls, world) * 1e6)
            med = {k: float(np.median(v)) for k, v in samples.items()}
            if world.rank == 0:
                print(
                    f"{np.dtype(dtype).name:>8} {n:>10} {med['predefined']:>10.1f} "
                    f"{med['user']:>11.1f} {med['user'] / med['predefined']:>10.2f} "
                    f"{med['local predefined']:>10.1f} {med['local user']:>11.1f} "
                    f"{med['local user'] / med['local predefined']:>10.2f} "
                    f"{med['jit']:>18.1f}"
                )
    jc.free()


if __name__ == "__main__":
    main()
