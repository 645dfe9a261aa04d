"""Gather family: allgather, gather, scatter, alltoall and their variable-size forms.

The fixed-size primitives take ``size`` (the communicator's) and ``tiled`` to
compute their output shapes. The variable-size ones take per-rank counts of
leading-axis rows as tuples; the kernels get them as int64 array attributes
and scale them by the elements of one row.
"""

import jax

from ._adjoint import register
from ._base import comm_primitive, def_linear, rank_of, replicated_operand, same_as_input
from ._batching import batch_whole, behind_rows, split, stacked


def _rows(aval, rows):
    return [jax.core.ShapedArray((rows, *aval.shape[1:]), aval.dtype)]


def _stacked(aval, *, size, tiled, **_):
    if tiled:
        shape = (size * aval.shape[0], *aval.shape[1:])
    else:
        shape = (size, *aval.shape)
    return [jax.core.ShapedArray(shape, aval.dtype)]


def _split(aval, *, size, tiled, **_):
    if tiled:
        return _rows(aval, aval.shape[0] // size)
    return [jax.core.ShapedArray(aval.shape[1:], aval.dtype)]


def _all_rows(aval, *, counts, **_):
    return _rows(aval, sum(counts))


def _own_rows(aval, *, counts, rank, **_):
    return _rows(aval, counts[rank])


def _received_rows(aval, *, recvcounts, **_):
    return _rows(aval, sum(recvcounts))


allgather_p = comm_primitive("allgather", _stacked, "jaxcomm_allgather", ("handle",))
# MPI reads a gather's output and a scatter's input on the root only.
gather_p = comm_primitive(
    "gather", _stacked, "jaxcomm_gather", ("handle", "root"), root_only="output"
)
scatter_p = comm_primitive(
    "scatter", _split, "jaxcomm_scatter", ("handle", "root"), root_only="input"
)
# alltoall's output could take its input's buffer, but MPI_Alltoall's in-place
# form exchanges through a temporary copy (MPICH: MPI_Sendrecv_replace per
# peer), so it keeps a buffer of its own; so do the ops whose output is not
# shaped like their input.
alltoall_p = comm_primitive("alltoall", same_as_input, "jaxcomm_alltoall", ("handle",))
allgatherv_p = comm_primitive("allgatherv", _all_rows, "jaxcomm_allgatherv", ("handle", "counts"))
gatherv_p = comm_primitive(
    "gatherv", _all_rows, "jaxcomm_gatherv", ("handle", "counts", "root"), root_only="output"
)
scatterv_p = comm_primitive(
    "scatterv", _own_rows, "jaxcomm_scatterv", ("handle", "counts", "root"), root_only="input"
)
alltoallv_p = comm_primitive(
    "alltoallv",
    _received_rows,
    "jaxcomm_alltoallv",
    ("handle", "sendcounts", "recvcounts", "max_rows"),
)


def allgather(x, *, size, tiled, handle, replicated=True):
    """Bind ``allgather_p``: ``MPI_Allgather`` of ``x``, stacked or concatenated.

    ``replicated`` picks the transpose (see ``_crossing.py``).
    """
    x, replicated = replicated_operand(x, handle, replicated)
    (y,) = allgather_p.bind(x, size=size, tiled=tiled, handle=handle, replicated=replicated)
    return y


def gather(x, *, root, size, tiled, handle):
    """Bind ``gather_p``: ``MPI_Gather`` to ``root``; zeros elsewhere."""
    (y,) = gather_p.bind(x, root=root, size=size, tiled=tiled, handle=handle)
    return y


def scatter(x, *, root, size, tiled, handle):
    """Bind ``scatter_p``: ``MPI_Scatter`` of root's ``x`` along its leading axis."""
    (y,) = scatter_p.bind(x, root=root, size=size, tiled=tiled, handle=handle)
    return y


def alltoall(x, *, handle):
    """Bind ``alltoall_p``: ``MPI_Alltoall`` of ``size`` equal leading-axis blocks."""
    (y,) = alltoall_p.bind(x, handle=handle)
    return y


def allgatherv(x, *, counts, handle, replicated=True):
    """Bind ``allgatherv_p``: ``MPI_Allgatherv``; ``counts`` holds every rank's rows.

    ``replicated`` picks the transpose (see ``_crossing.py``).
    """
    x, replicated = replicated_operand(x, handle, replicated)
    (y,) = allgatherv_p.bind(x, counts=counts, handle=handle, replicated=replicated)
    return y


def gatherv(x, *, counts, root, handle):
    """Bind ``gatherv_p``: ``MPI_Gatherv`` to ``root``; zeros elsewhere."""
    (y,) = gatherv_p.bind(x, counts=counts, root=root, handle=handle)
    return y


def scatterv(x, *, counts, root, rank, handle):
    """Bind ``scatterv_p``: ``MPI_Scatterv``; this ``rank`` gets ``counts[rank]`` rows."""
    (y,) = scatterv_p.bind(x, counts=counts, root=root, rank=rank, handle=handle)
    return y


def alltoallv(x, *, sendcounts, recvcounts, max_rows, handle):
    """Bind ``alltoallv_p``: ``MPI_Alltoallv``.

    ``sendcounts`` and ``recvcounts`` are this rank's row and column of the
    counts matrix; ``max_rows`` is the largest count or displacement (in rows)
    anywhere in it, so that every rank picks the same large-count path.
    """
    (y,) = alltoallv_p.bind(
        x, sendcounts=sendcounts, recvcounts=recvcounts, max_rows=max_rows, handle=handle
    )
    return y


# vmap -------------------------------------------------------------------------

batch_whole(allgather_p, stacked)
batch_whole(gather_p, stacked)
batch_whole(scatter_p, split)
for _prim in (alltoall_p, allgatherv_p, gatherv_p, scatterv_p, alltoallv_p):
    batch_whole(_prim, behind_rows)


# Differentiation -------------------------------------------------------------
#
# Every op here is linear. A user's allgather and allgatherv results are
# replicated values, so each rank's input gets its own slice of the cotangent
# (bound as replicated_adjoint_p, whose transpose is the gather again). An
# allgather bound by a transpose (of reduce_scatter) maps per-rank values to
# per-rank values and transposes exactly, to a reduction: the rules of
# allgather and allgatherv are registered in _crossing.py. The other ops
# transpose exactly: gather <-> scatter, gatherv <-> scatterv, alltoall to
# itself and alltoallv to itself with the counts matrix transposed.


def _own_block(ct, rank, *, size, tiled):
    if not tiled:
        return ct[rank]
    rows = ct.shape[0] // size
    return ct[rank * rows : (rank + 1) * rows]


def rank_rows(ct, rank, *, counts):
    """``rank``'s rows of an allgatherv result ``ct`` of ``counts`` rows per rank."""
    start = sum(counts[:rank])
    return ct[start : start + counts[rank]]


register(
    "allgather",
    _own_block,
    lambda ct, aval, *, size, tiled, handle: allgather(ct, size=size, tiled=tiled, handle=handle),
)
register(
    "allgatherv",
    rank_rows,
    lambda ct, aval, *, counts, handle: allgatherv(ct, counts=counts, handle=handle),
)


def _gather_transpose(ct, aval, *, root, size, tiled, handle):
    return scatter(ct, root=root, size=size, tiled=tiled, handle=handle)


def _scatter_transpose(ct, aval, *, root, size, tiled, handle):
    return gather(ct, root=root, size=size, tiled=tiled, handle=handle)


def _alltoall_transpose(ct, aval, *, handle):
    return alltoall(ct, handle=handle)


def _gatherv_transpose(ct, aval, *, counts, root, handle):
    return scatterv(ct, counts=counts, root=root, rank=rank_of(handle), handle=handle)


def _scatterv_transpose(ct, aval, *, counts, root, rank, handle):
    return gatherv(ct, counts=counts, root=root, handle=handle)


def _alltoallv_transpose(ct, aval, *, sendcounts, recvcounts, max_rows, handle):
    # The transposed matrix has the same entries and swaps rows with columns,
    # so max_rows carries over.
    return alltoallv(
        ct, sendcounts=recvcounts, recvcounts=sendcounts, max_rows=max_rows, handle=handle
    )


def_linear(gather_p, _gather_transpose)
def_linear(scatter_p, _scatter_transpose)
def_linear(alltoall_p, _alltoall_transpose)
def_linear(gatherv_p, _gatherv_transpose)
def_linear(scatterv_p, _scatterv_transpose)
def_linear(alltoallv_p, _alltoallv_transpose)
