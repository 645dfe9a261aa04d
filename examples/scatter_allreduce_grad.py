"""Rank 0 scatters a vector, the last rank doubles its chunk, an allreduce sums them.

The JPI seed program. Run:  mpiexec -n 4 python examples/scatter_allreduce_grad.py
Every rank prints "Rank r has result 41.0": chunks [0, 1], [2, 3], [4, 5] and
the doubled [12, 14] add up to [18, 23], whose sum is 41.

Then every rank prints its gradient with respect to its own ``x``. The
allreduce result is one replicated value (its cotangent is not summed over
ranks), so root's gradient is 1 for each element and 2 for the last rank's
doubled chunk; the other ranks' ``x`` are never read, so their gradients are
zero. ``jax.grad`` and ``jax.jit(jax.grad(...))`` must agree.
"""

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from jaxcomm import JaxComm

jc = JaxComm(MPI.COMM_WORLD)


@jax.jit
def scatter_double_sum(x):
    """A scalar function of root's ``x``, written so that ``jax.grad`` applies."""
    chunk = jc.scatter(x, root=0, tiled=True)
    if jc.rank == jc.size - 1:
        chunk = 2 * chunk
    return jnp.sum(jc.allreduce(chunk, op=MPI.SUM))


# Only root's values are read; the other ranks pass zeros of the same shape.
x = jnp.arange(2 * jc.size, dtype=jnp.float32) * (jc.rank == 0)
result = scatter_double_sum(x)
# One write per line, newline included, so that mpiexec does not interleave
# the ranks' lines.
print(f"Rank {jc.rank} has result {float(result)}\n", end="", flush=True)

gradient = jax.grad(scatter_double_sum)(x)
jitted_gradient = jax.jit(jax.grad(scatter_double_sum))(x)
if not np.array_equal(gradient, jitted_gradient):
    raise SystemExit(f"Rank {jc.rank}: grad {gradient} != jit(grad) {jitted_gradient}")
print(
    f"Rank {jc.rank} has result {float(result)} and gradient {np.asarray(gradient)}\n",
    end="",
    flush=True,
)
