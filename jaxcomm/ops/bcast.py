"""Broadcast."""

from ._base import comm_primitive, same_as_input

bcast_p = comm_primitive("bcast", same_as_input, "jaxcomm_bcast", ("comm", "root"))


def bcast(x, *, root, comm):
    """Bind ``bcast_p``: ``MPI_Bcast`` of root's ``x``."""
    (y,) = bcast_p.bind(x, root=root, comm=comm)
    return y
