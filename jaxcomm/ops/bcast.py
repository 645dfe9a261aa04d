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
    return ct if rank == root else jnp.zeros_like(ct)


register(
    "bcast", _root_keeps, lambda ct, aval, *, root, handle: bcast(ct, root=root, handle=handle)
)
