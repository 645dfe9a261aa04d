"""Synchronisation: barrier."""

from ._base import comm_primitive, no_output
from ._batching import batch_whole, flat

barrier_p = comm_primitive("barrier", no_output, "jaxcomm_barrier", ("handle",))


def barrier(*, handle):
    """Bind ``barrier_p``: ``MPI_Barrier``."""
    barrier_p.bind(handle=handle)


# vmap -------------------------------------------------------------------------

batch_whole(barrier_p, flat)
