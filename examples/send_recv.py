"""Two ranks swap arrays with send and recv.

Run:  mpiexec -n 2 python examples/send_recv.py
Rank 0 prints a 3x3 array of ones (rank 1's array), rank 1 prints zeros.
"""

import jax.numpy as jnp
from mpi4py import MPI

from jaxcomm import JaxComm

jc = JaxComm(MPI.COMM_WORLD)
if jc.size != 2:
    raise SystemExit(f"send_recv.py needs exactly 2 ranks, got {jc.size}")

x = jnp.zeros((3, 3)) + jc.rank
other = 1 - jc.rank
# Rank 0 sends first and rank 1 receives first, so the blocking calls pair up.
if jc.rank == 0:
    jc.send(x, dest=other)
    y = jc.recv(x, source=other)
else:
    y = jc.recv(x, source=other)
    jc.send(x, dest=other)

prefix = f"r{jc.rank} | "
# One write, newline included, so that mpiexec does not interleave the ranks' lines.
print(prefix + str(y).replace("\n", "\n" + prefix) + "\n", end="", flush=True)
