"""Broadcast."""

from ._base import comm_primitive, same_as_input
from ._batching import batch_whole, flat

bcast_p = comm_primitive("bcast", same_as_input, "jaxcomm_bcast", ("comm", "root"))


def bcast(x, *, root, comm):
    """Bind ``bcast_p``: ``MPI_Bcast`` of root's ``x``."""
    (y,) = bcast_p.bind(x, root=root, comm=comm)
    return y


# vmap -------------------------------------------------------------------------

batch_whole(bcast_p, flat)
