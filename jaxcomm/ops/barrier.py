"""Synchronisation: barrier."""

from ._base import comm_primitive, no_output
from ._batching import batch_whole, flat

barrier_p = comm_primitive("barrier", no_output, "jaxcomm_barrier", ("comm",))


def barrier(*, comm):
    """Bind ``barrier_p``: ``MPI_Barrier``."""
    barrier_p.bind(comm=comm)


# vmap -------------------------------------------------------------------------

batch_whole(barrier_p, flat)
