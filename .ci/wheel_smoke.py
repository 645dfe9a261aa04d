"""Smoke program for an installed binary wheel (.ci/wheel_leg.sh): run it on 2 or more ranks.

    mpiexec -n 2 python .ci/wheel_smoke.py

Covers what a user's first program touches: a jitted collective, a
gradient through one, a loop of sendrecvs in ``fori_loop``, a ragged
exchange and the mpi4jax compat module, each checked against its value in
terms of the rank count, and that no CUDA library was loaded. Rank 0 prints one line naming the jax, Python and
MPI it ran with, then ``wheel smoke: ok``; any failure raises (and aborts
the job).
"""

import platform

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import jaxcomm
import jaxcomm.compat.mpi4jax as mpi4jax
from jaxcomm import JaxComm

jc = JaxComm(MPI.COMM_WORLD)
rank, size = jc.rank, jc.size

# jit
total = jax.jit(lambda x: jc.allreduce(x, op=MPI.SUM))(jnp.full((3,), float(rank)))
np.testing.assert_allclose(total, np.full(3, size * (size - 1) / 2))

# grad: allreduce(SUM) is one replicated value, so its transpose is the identity.
gradient = jax.grad(lambda x: jnp.sum(jc.allreduce(x * x, op=MPI.SUM)))(jnp.arange(3.0))
np.testing.assert_allclose(gradient, 2 * np.arange(3.0))


# a loop of sendrecvs around the ring: after `steps` shifts each rank holds
# the value of the rank `steps` places before it.
@jax.jit
def ring(x, steps):
    def shift(_, y):
        return jc.sendrecv(y, y, source=(rank - 1) % size, dest=(rank + 1) % size)

    return jax.lax.fori_loop(0, steps, shift, x)


for steps in (1, 5, 2 * size + 1):
    np.testing.assert_allclose(ring(jnp.full((4,), float(rank)), steps), (rank - steps) % size)

# a ragged exchange: rank r sends j + 1 rows of r to rank j, which writes them
# at rows r * (j + 1) on.
sizes = np.arange(1, size + 1, dtype=np.int32)
operand = jnp.full((int(sizes.sum()),), float(rank))
received = jax.jit(jc.ragged_all_to_all)(
    operand,
    jnp.zeros((size * size,)),
    jnp.asarray(np.concatenate([[0], np.cumsum(sizes)[:-1]]), dtype=jnp.int32),
    jnp.asarray(sizes),
    jnp.asarray(rank * sizes),
    jnp.full((size,), rank + 1, dtype=jnp.int32),
)
want = np.zeros(size * size)
for source in range(size):
    want[source * (rank + 1) : (source + 1) * (rank + 1)] = source
np.testing.assert_allclose(received, want)

# the mpi4jax compat module, functional style
shifted = jax.jit(
    lambda x: mpi4jax.sendrecv(x, x, source=(rank + 1) % size, dest=(rank - 1) % size)
)(jnp.full((2,), float(rank)))
np.testing.assert_allclose(shifted, (rank + 1) % size)
np.testing.assert_allclose(mpi4jax.allreduce(jnp.ones(()), op=MPI.SUM), size)

jaxcomm.sync()

# The CPU path needs no CUDA library: on a machine without jax's CUDA plugin
# a wheel with CUDA kernels loads neither them nor any CUDA library.
with open("/proc/self/maps") as maps:
    cuda_libraries = {
        line.split()[-1]
        for line in maps
        if any(name in line for name in ("libcuda", "_kernels_cuda", "libjaxcomm_cuda"))
    }
assert not cuda_libraries, cuda_libraries

if rank == 0:
    info = jaxcomm.build_info()
    print(
        f"jax {jax.__version__}, Python {platform.python_version()}, {size} ranks, "
        f"{info['mpi_library']} (kernels: {info['mpi_abi'] or info['mpi_built']}, "
        f"FFI headers of jaxlib {info['jaxlib_built']})"
    )
    print("wheel smoke: ok")
