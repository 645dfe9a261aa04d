"""Broadcast."""

import jax.numpy as jnp

from ._adjoint import register
from ._base import comm_primitive, replicated_operand, same_as_input
from ._batching import batch_whole, flat

# MPI_Bcast works in place: with the input's buffer the root sends from where
# its data already is.
bcast_p = comm_primitive("bcast", same_as_input, "jaxcomm_bcast", ("handle", "root"), in_place=True)


def bcast(x, *, root, handle, replicated=True):
    """Bind ``bcast_p``: ``MPI_Bcast`` of root's ``x``.

    ``replicated`` picks the transpose (see ``_crossing.py``); it does not
    change what the call computes.
    """
    x, replicated = replicated_operand(x, handle, replicated)
    (y,) = bcast_p.bind(x, root=root, handle=handle, replicated=replicated)
    return y


# vmap -------------------------------------------------------------------------

batch_whole(bcast_p, flat)


# Differentiation: a user's broadcast value is one replicated value, so root
# keeps its cotangent and the other ranks' inputs, never read, get zeros. The
# rules bind reductions too, so they are registered in _crossing.py.


def _root_keeps(ct, rank, *, root):
    if rank == root:
        return ct
    # Zeros that still read ct, so that every process's program uses ct alike:
    # inside shard_map with check_vma, ct is the psum JAX writes for the
    # transpose of its cast to varying, and plain zeros let XLA drop that psum
    # as dead code on the other ranks only, leaving root to wait in it for
    # ever. XLA does not fold ct * 0 for floats (NaN * 0 is NaN); the where
    # makes the zeros exact for every ct.
    return jnp.where(jnp.isfinite(ct), ct * 0, jnp.zeros_like(ct))


register(
    "bcast", _root_keeps, lambda ct, aval, *, root, handle: bcast(ct, root=root, handle=handle)
)
