"""Broadcast."""

import jax.numpy as jnp

from ._adjoint import register, replicated_adjoint
from ._base import comm_primitive, def_linear, same_as_input
from ._batching import batch_whole, flat

# MPI_Bcast works in place: with the input's buffer the root sends from where
# its data already is.
bcast_p = comm_primitive("bcast", same_as_input, "jaxcomm_bcast", ("handle", "root"), in_place=True)


def bcast(x, *, root, handle, replicated=True):
    """Bind ``bcast_p``: ``MPI_Bcast`` of root's ``x``.

    ``replicated`` picks the transpose (see ``_bcast_transpose``); it does not
    change what the call computes.
    """
    (y,) = bcast_p.bind(x, root=root, handle=handle, replicated=replicated)
    return y


# vmap -------------------------------------------------------------------------

batch_whole(bcast_p, flat)


# Differentiation: a user's broadcast value is one replicated value, so root
# keeps its cotangent and the other ranks' inputs, never read, get zeros. A
# broadcast bound by a transpose (of reduce) maps per-rank values to per-rank
# values and transposes exactly, to reduce.


def _root_keeps(ct, rank, *, root):
    return ct if rank == root else jnp.zeros_like(ct)


def _bcast_transpose(ct, aval, *, root, handle, replicated):
    if replicated:
        return replicated_adjoint(ct, kind="bcast", root=root, handle=handle)
    # reduction.py imports this module for reduce's transpose.
    from .reduction import SUM, reduce

    return reduce(ct, op=SUM, root=root, handle=handle)


register(
    "bcast", _root_keeps, lambda ct, aval, *, root, handle: bcast(ct, root=root, handle=handle)
)
def_linear(bcast_p, _bcast_transpose)
