"""A jitted ring sendrecv and allreduce, for the CI's network-transport check.

Run under ``UCX_PROTO_INFO=y``, UCX prints the transport it picked for each
peer; the CI reads that. Prints ``network path: right`` on each rank whose
result is right.
"""

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from jaxcomm import JaxComm

jc = JaxComm(MPI.COMM_WORLD)
rank, size = jc.rank, jc.size
# Large enough for UCX's rendezvous protocol as well as its eager ones.
x = jnp.full(1 << 17, float(rank))
step = jax.jit(
    lambda x: jc.sendrecv(x, x, source=(rank - 1) % size, dest=(rank + 1) % size) + jc.allreduce(x)
)
y = np.asarray(step(x))
right = np.array_equal(y, np.full(x.shape, (rank - 1) % size + size * (size - 1) / 2))
print(f"rank {rank}: network path: {'right' if right else 'WRONG'}", flush=True)
