"""Reductions: allreduce, reduce, scan, exscan, reduce_scatter."""

import jax

from ._base import comm_primitive, same_as_input
from ._batching import batch_whole, flat, split


def _reduce_scatter_abstract_eval(aval, *, size, tiled, **_):
    shape = (aval.shape[0] // size, *aval.shape[1:]) if tiled else aval.shape[1:]
    return [jax.core.ShapedArray(shape, aval.dtype)]


allreduce_p = comm_primitive("allreduce", same_as_input, "jaxcomm_allreduce", ("comm", "op"))
reduce_p = comm_primitive("reduce", same_as_input, "jaxcomm_reduce", ("comm", "op", "root"))
scan_p = comm_primitive("scan", same_as_input, "jaxcomm_scan", ("comm", "op"))
exscan_p = comm_primitive("exscan", same_as_input, "jaxcomm_exscan", ("comm", "op"))
# The kernel reads the block size off its output; size and tiled only shape it.
reduce_scatter_p = comm_primitive(
    "reduce_scatter", _reduce_scatter_abstract_eval, "jaxcomm_reduce_scatter", ("comm", "op")
)


def allreduce(x, *, op, comm):
    """Bind ``allreduce_p``: ``MPI_Allreduce`` with reduction code ``op``."""
    (y,) = allreduce_p.bind(x, op=op, comm=comm)
    return y


def reduce(x, *, op, root, comm):
    """Bind ``reduce_p``: ``MPI_Reduce`` onto ``root``; other ranks get zeros."""
    (y,) = reduce_p.bind(x, op=op, root=root, comm=comm)
    return y


def scan(x, *, op, comm):
    """Bind ``scan_p``: ``MPI_Scan``, the inclusive prefix reduction."""
    (y,) = scan_p.bind(x, op=op, comm=comm)
    return y


def exscan(x, *, op, comm):
    """Bind ``exscan_p``: ``MPI_Exscan``, the exclusive prefix reduction (zeros on rank 0)."""
    (y,) = exscan_p.bind(x, op=op, comm=comm)
    return y


def reduce_scatter(x, *, op, size, tiled, comm):
    """Bind ``reduce_scatter_p``: ``MPI_Reduce_scatter_block`` over ``size`` blocks of ``x``."""
    (y,) = reduce_scatter_p.bind(x, op=op, size=size, tiled=tiled, comm=comm)
    return y


# vmap -------------------------------------------------------------------------

for _prim in (allreduce_p, reduce_p, scan_p, exscan_p):
    batch_whole(_prim, flat)
batch_whole(reduce_scatter_p, split)
