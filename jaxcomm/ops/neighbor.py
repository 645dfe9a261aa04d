"""Neighbourhood collectives: ``neighbor_alltoall``, ``neighbor_allgather``, ``neighbor_alltoallv``, ``neighbor_allgatherv``.

Their nonblocking forms are in ``nonblocking.py``; the helpers of
``neighbor_alltoallv``'s and ``neighbor_allgatherv``'s counts below serve
``ineighbor_alltoallv`` and ``ineighbor_allgatherv`` too.

They run on a communicator with a topology, a distributed graph
(``MPI_Dist_graph_create_adjacent``), a Cartesian grid or a graph
(``MPI_Graph_create``, whose neighbours are both lists), whose neighbour
lists each ``JaxComm`` registers here by handle (:func:`register_topology`):
``sources`` (this rank receives block ``i`` from ``sources[i]``) and
``destinations`` (block ``j`` goes to ``destinations[j]``), in MPI's order.
On a Cartesian grid both lists are, per dimension, the neighbour at
``-1`` then the one at ``+1``, ``MPI.PROC_NULL`` off a non-periodic edge;
blocks from ``MPI.PROC_NULL`` come back as zeros.

The transpose of an exchange is the exchange backwards: each rank's
cotangent blocks go back to the neighbours they came from, as one
neighbourhood collective on the reverse communicator (sources and
destinations swapped), which every ``JaxComm`` with a graph topology makes
when it is created. A Cartesian grid is its own reverse: the block a rank
sent towards ``-1`` arrived at that neighbour from ``+1``. So is a graph,
whose adjacency is symmetric: the k-th block from a rank to a neighbour is
the k-th that neighbour receives from it, and the k-th it sends back.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad
from mpi4py import MPI

from .. import _compat
from ._base import comm_primitive, def_linear, derivative_comm
from ._batching import batch_whole, batched_alike, behind_rows
from .ragged import exchange_batch, exchange_jvp

# handle -> (sources, destinations), and handle -> the handle of the
# communicator its exchanges transpose on.
_topologies = {}
_reverse = {}


def register_topology(handle, sources, destinations, reverse):
    """Record the neighbours of communicator ``handle`` and its reverse's handle."""
    _topologies[handle] = (tuple(sources), tuple(destinations))
    _reverse[handle] = reverse


def unregister_topology(handle):
    """Forget ``handle``'s neighbours (before it is freed)."""
    _topologies.pop(handle, None)
    _reverse.pop(handle, None)


def neighbors(handle):
    """``(sources, destinations)`` of the communicator behind ``handle``."""
    return _topologies[handle]


def reverse_comm(handle):
    """The communicator (handle) the transpose of an exchange on ``handle`` runs on."""
    return _reverse[handle]


def indegree(handle):
    """The number of sources of the communicator behind ``handle``."""
    return len(_topologies[handle][0])


def blocks_behind(**_):
    """vmap layout of neighbor_allgather: a new leading axis of blocks, the batch behind it."""
    return 0, 1


def _outdegree(handle):
    return len(_topologies[handle][1])


def _blocks(aval, *, handle):
    return [jax.core.ShapedArray((indegree(handle), *aval.shape[1:]), aval.dtype)]


def _stacked(aval, *, handle):
    return [jax.core.ShapedArray((indegree(handle), *aval.shape), aval.dtype)]


def _counted(x, output, counts, *, handle, **_):
    return [
        jax.core.ShapedArray(output.shape, output.dtype),
        jax.core.ShapedArray((indegree(handle),), counts.dtype),
    ]


neighbor_alltoall_p = comm_primitive(
    "neighbor_alltoall", _blocks, "jaxcomm_neighbor_alltoall", ("handle",)
)
neighbor_allgather_p = comm_primitive(
    "neighbor_allgather", _stacked, "jaxcomm_neighbor_allgather", ("handle",)
)
# The result takes the output's buffer, as ragged_all_to_all's.
neighbor_alltoallv_p = comm_primitive(
    "neighbor_alltoallv",
    _counted,
    "jaxcomm_neighbor_alltoallv",
    ("handle", "check_sizes"),
    aliases={1: 0},
)
# neighbor_alltoallv_p's operands and results, with the sendcounts one count
# repeated: the same first rows of x go to every destination.
neighbor_allgatherv_p = comm_primitive(
    "neighbor_allgatherv",
    _counted,
    "jaxcomm_neighbor_allgatherv",
    ("handle", "check_sizes"),
    aliases={1: 0},
)


def zero_from_nowhere(y, handle):
    """``y`` with the blocks from ``MPI.PROC_NULL`` sources zeroed (MPI leaves them unwritten)."""
    sources = _topologies[handle][0]
    nowhere = np.array([s == MPI.PROC_NULL for s in sources])
    if not nowhere.any():
        return y
    return jnp.where(nowhere.reshape((-1,) + (1,) * (y.ndim - 1)), jnp.zeros_like(y), y)


def neighbor_alltoall(x, *, handle):
    """Bind ``neighbor_alltoall_p``: block ``j`` of ``x`` to ``destinations[j]``."""
    (y,) = neighbor_alltoall_p.bind(x, handle=handle)
    return zero_from_nowhere(y, handle)


def neighbor_allgather(x, *, handle):
    """Bind ``neighbor_allgather_p``: ``x`` to every destination, one block per source back."""
    (y,) = neighbor_allgather_p.bind(x, handle=handle)
    return zero_from_nowhere(y, handle)


def neighbor_alltoallv(x, output, sendcounts, recvcounts, *, handle):
    """Bind ``neighbor_alltoallv_p``: blocks of ``sendcounts`` rows, packed into ``output``.

    ``recvcounts`` (or None: learned) are checked against what arrives.

    Returns:
        The output and the rows received from each source.
    """
    counts, check = neighbor_counts(sendcounts, recvcounts, handle)
    return neighbor_alltoallv_p.bind(x, output, counts, handle=handle, check_sizes=int(check))


def neighbor_allgatherv(x, output, sendcount, recvcounts, *, handle):
    """Bind ``neighbor_allgatherv_p``: x's first ``sendcount`` rows to every destination, packed into ``output``.

    ``recvcounts`` (or None: learned) are checked against what arrives.

    Returns:
        The output and the rows received from each source.
    """
    counts, check = gathered_counts(sendcount, recvcounts, handle)
    return neighbor_allgatherv_p.bind(x, output, counts, handle=handle, check_sizes=int(check))


def gathered_counts(sendcount, recvcounts, handle):
    """The counts operand of a neighbor_allgatherv (``sendcount`` per destination, then recvcounts), and whether it checks them."""
    dtype = jnp.result_type(sendcount)
    if recvcounts is not None:
        dtype = jnp.promote_types(dtype, recvcounts.dtype)
    sendcounts = jnp.full((_outdegree(handle),), sendcount, dtype)
    return neighbor_counts(sendcounts, recvcounts, handle)


def neighbor_counts(sendcounts, recvcounts, handle):
    """The counts operand of a neighbor_alltoallv (sendcounts, then recvcounts), and whether it checks them.

    Without ``recvcounts`` (learned) their place holds zeros.
    """
    check = recvcounts is not None
    if check:
        return jnp.concatenate([sendcounts, recvcounts.astype(sendcounts.dtype)]), check
    # Padded, not concatenated with a constant: XLA:CPU of jaxlib 0.6.2
    # aborts compiling a concatenate of a constant that feeds this call
    # ("Could not convert JSON string to proto").
    return jnp.pad(sendcounts, (0, indegree(handle))), check


def known_counts(counts, handle, *, check_sizes, **_):
    """The counts of an exchange with the recvcounts it learned in their place.

    They are learned again, from the sources' sendcounts: one
    neighbor_alltoall on the derivative communicator.
    """
    if check_sizes:
        return counts
    sendcounts = counts[: _outdegree(handle)]
    recvcounts = neighbor_alltoall(sendcounts, handle=derivative_comm(handle))
    return jnp.concatenate([sendcounts, recvcounts])


def _to_nowhere(handle):
    """Which destinations of ``handle`` are ``MPI.PROC_NULL`` (a mask), or None if none is."""
    nowhere = np.array([d == MPI.PROC_NULL for d in _topologies[handle][1]], bool)
    return nowhere if nowhere.any() else None


def returned_counts(sendcounts, handle):
    """The rows the transpose of an exchange by ``sendcounts`` gets back from each destination.

    Rows sent to ``MPI.PROC_NULL`` went nowhere, and nothing comes back from there.
    """
    nowhere = _to_nowhere(handle)
    if nowhere is None:
        return sendcounts
    return jnp.where(nowhere, jnp.zeros_like(sendcounts), sendcounts)


def rows_sent_back(packed, sendcounts, handle):
    """The cotangent of ``x``, from the rows a transposed exchange packed by ``returned_counts``.

    The reverse exchange packs what comes back contiguously; block ``j``
    belongs where the forward exchange read it, at ``sum(sendcounts[:j])``,
    and the rows sent to ``MPI.PROC_NULL`` (none came back) get zeros.
    """
    nowhere = _to_nowhere(handle)
    if nowhere is None:
        return packed
    returned = returned_counts(sendcounts, handle)
    ends = jnp.cumsum(sendcounts)
    starts = ends - sendcounts
    packed_starts = jnp.cumsum(returned) - returned
    rows = jnp.arange(packed.shape[0], dtype=ends.dtype)
    block = jnp.searchsorted(ends, rows, side="right")
    inside = jnp.minimum(block, len(nowhere) - 1)
    kept = (block < len(nowhere)) & ~jnp.asarray(nowhere)[inside]
    at = jnp.where(kept, packed_starts[inside] + rows - starts[inside], 0)
    moved = packed[at]
    return jnp.where(kept.reshape((-1,) + (1,) * (packed.ndim - 1)), moved, jnp.zeros_like(moved))


def reverse_counts(counts, handle, *, check_sizes, reverse, **_):
    """What the reverse of a started exchange by ``counts`` needs (``known_counts``).

    Its receive counts are the rows each destination gets back
    (``returned_counts``). A reverse exchange sends nothing to
    ``MPI.PROC_NULL`` (nothing came from there), so its own reverse needs
    its counts as they are.
    """
    known = known_counts(counts, handle, check_sizes=check_sizes)
    if reverse:
        return known
    sendcounts = known[: _outdegree(handle)]
    return jnp.concatenate([returned_counts(sendcounts, handle), known[_outdegree(handle) :]])


def sent_back(packed, counts, handle, *, reverse, **_):
    """``rows_sent_back`` for the exchange by ``counts`` (in its own order) a started reverse undoes."""
    if reverse:
        return packed
    return rows_sent_back(packed, counts[: _outdegree(handle)], handle)


def output_written(ct, counts, handle, *, reverse, **_):
    """``ct`` with the rows an exchange by ``counts`` (known, ``known_counts``) received zeroed."""
    received = counts[: indegree(handle)] if reverse else counts[_outdegree(handle) :]
    written = jnp.arange(ct.shape[0]) < received.sum()
    return jnp.where(written.reshape((-1,) + (1,) * (ct.ndim - 1)), 0, ct)


# vmap: blocks are rows, the batch goes behind them. --------------------------------

batch_whole(neighbor_alltoall_p, behind_rows)
batch_whole(neighbor_allgather_p, blocks_behind)
_compat.fancy_primitive_batchers[neighbor_alltoallv_p] = partial(
    exchange_batch, neighbor_alltoallv_p
)


# Differentiation ----------------------------------------------------------------
#
# Every exchange is linear in its data. neighbor_alltoall transposes to itself
# on the reverse communicator; neighbor_allgather to that and a sum over the
# blocks each destination sends back; neighbor_alltoallv to itself on the
# reverse communicator with the counts swapped, the rows each source sent
# learned by a neighbor_alltoall of the counts where the forward exchange
# learned them. Rows sent to MPI.PROC_NULL (off a non-periodic grid's edge)
# went nowhere: nothing comes back for them, and their cotangent is zero.


def _alltoall_transpose(ct, aval, *, handle):
    return neighbor_alltoall(ct, handle=reverse_comm(handle))


def _allgather_transpose(ct, aval, *, handle):
    return neighbor_alltoall(ct, handle=reverse_comm(handle)).sum(0).astype(aval.dtype)


def_linear(neighbor_alltoall_p, _alltoall_transpose)
def_linear(neighbor_allgather_p, _allgather_transpose)


def _alltoallv_transpose(cts, x, output, counts, *, handle, check_sizes):
    ct = batched_alike(ad.instantiate_zeros(cts[0]))
    known = known_counts(counts, handle, check_sizes=check_sizes)
    sendcounts, recvcounts = known[: _outdegree(handle)], known[_outdegree(handle) :]
    aval = x.aval if ad.is_undefined_primal(x) else jax.core.get_aval(x)
    zeros = batched_alike(jnp.zeros(aval.shape, aval.dtype))
    packed, _ = neighbor_alltoallv_p.bind(
        ct,
        zeros,
        jnp.concatenate([recvcounts, returned_counts(sendcounts, handle)]),
        handle=reverse_comm(handle),
        check_sizes=1,
    )
    x_t = rows_sent_back(packed, sendcounts, handle)
    output_t = None
    if ad.is_undefined_primal(output):
        output_t = output_written(ct, known, handle, reverse=0)
    return [x_t if ad.is_undefined_primal(x) else None, output_t, None]


ad.primitive_jvps[neighbor_alltoallv_p] = partial(exchange_jvp, neighbor_alltoallv_p)
ad.primitive_transposes[neighbor_alltoallv_p] = _alltoallv_transpose


# neighbor_allgatherv transposes to a neighbor_alltoallv on the reverse
# communicator: each source gets back the cotangent of the rows it sent
# (as the forward learned or checked them), each destination returns its
# cotangent of this rank's rows, and this rank sums them. A destination
# that is MPI.PROC_NULL received nothing, so nothing comes back from it.


def allgatherv_transpose(ct, x, output, counts, *, handle, check_sizes):
    """Cotangents of ``(x, output, counts)`` of a neighbor_allgatherv by ``counts``, for ``ct`` of its result."""
    ct = batched_alike(ad.instantiate_zeros(ct))
    known = known_counts(counts, handle, check_sizes=check_sizes)
    outdegree = _outdegree(handle)
    sendcounts, recvcounts = known[:outdegree], known[outdegree:]
    aval = x.aval if ad.is_undefined_primal(x) else jax.core.get_aval(x)
    rows, row = aval.shape[0], aval.shape[1:]
    reached = np.array([d != MPI.PROC_NULL for d in _topologies[handle][1]], bool)
    back = jnp.where(reached, sendcounts, 0)
    zeros = batched_alike(jnp.zeros((outdegree * rows, *row), aval.dtype))
    returned, _ = neighbor_alltoallv_p.bind(
        ct,
        zeros,
        jnp.concatenate([recvcounts, back]),
        handle=reverse_comm(handle),
        check_sizes=1,
    )
    x_t = _sum_blocks(returned, back, rows)
    output_t = None
    if ad.is_undefined_primal(output):
        output_t = output_written(ct, known, handle, reverse=0)
    return [x_t if ad.is_undefined_primal(x) else None, output_t, None]


def _sum_blocks(packed, counts, rows):
    """The sum of the blocks of ``counts`` rows packed in ``packed``, each padded to ``rows`` rows."""
    if counts.shape[0] == 0 or rows == 0:
        return jnp.zeros((rows, *packed.shape[1:]), packed.dtype)
    starts = jnp.cumsum(counts) - counts
    at = jnp.arange(rows)
    index = jnp.minimum(starts[:, None] + at, packed.shape[0] - 1)
    blocks = packed[index]
    kept = (at < counts[:, None]).reshape(index.shape + (1,) * (packed.ndim - 1))
    return jnp.where(kept, blocks, jnp.zeros_like(blocks)).sum(0)


_compat.fancy_primitive_batchers[neighbor_allgatherv_p] = partial(
    exchange_batch, neighbor_allgatherv_p
)
ad.primitive_jvps[neighbor_allgatherv_p] = partial(exchange_jvp, neighbor_allgatherv_p)
ad.primitive_transposes[neighbor_allgatherv_p] = lambda cts, x, output, counts, **params: (
    allgatherv_transpose(cts[0], x, output, counts, **params)
)
