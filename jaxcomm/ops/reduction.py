"""Reductions: allreduce."""

from ._base import comm_primitive, same_as_input

allreduce_p = comm_primitive("allreduce", same_as_input, "jaxcomm_allreduce", ("comm", "op"))


def allreduce(x, *, op, comm):
    """Bind ``allreduce_p``: ``MPI_Allreduce`` with reduction code ``op``."""
    (y,) = allreduce_p.bind(x, op=op, comm=comm)
    return y
