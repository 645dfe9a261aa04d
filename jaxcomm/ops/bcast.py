"""Broadcast."""

import jax.numpy as jnp

from ._base import comm_primitive, def_linear, rank_of, same_as_input
from ._batching import batch_whole, flat

bcast_p = comm_primitive("bcast", same_as_input, "jaxcomm_bcast", ("comm", "root"))


def bcast(x, *, root, comm):
    """Bind ``bcast_p``: ``MPI_Bcast`` of root's ``x``."""
    (y,) = bcast_p.bind(x, root=root, comm=comm)
    return y


# vmap -------------------------------------------------------------------------

batch_whole(bcast_p, flat)


# Differentiation: the broadcast value is one replicated value, so root keeps
# its cotangent and the other ranks' inputs, never read, get zeros.


def _bcast_transpose(ct, aval, *, root, comm):
    return ct if rank_of(comm) == root else jnp.zeros_like(ct)


def_linear(bcast_p, _bcast_transpose)
