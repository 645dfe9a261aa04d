"""Each rank adds its rank to a 3x3 array of zeros; a jitted allreduce sums them.

Run:  mpiexec -n 4 python examples/global_sum.py
With 4 ranks, rank 0 prints a 3x3 array of 6.0 (0 + 1 + 2 + 3).
"""

import jax
import jax.numpy as jnp
from mpi4py import MPI

from jaxcomm import JaxComm

jc = JaxComm(MPI.COMM_WORLD)


@jax.jit
def global_sum(x):
    return jc.allreduce(x, op=MPI.SUM)


result = global_sum(jnp.zeros((3, 3)) + jc.rank)
if jc.rank == 0:
    print(result)
