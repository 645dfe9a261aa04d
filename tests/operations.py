"""The one table of jaxcomm's operations, for every per-operation test.

Each row is one way of calling the public API: an operation (the ``JaxComm``
method) or a variant of one (another reduction op, ``tiled=True``, another
root), named ``<method>`` or ``<method>-<variant>``. A row says how to call it
on a ``JaxComm`` (the same function runs eagerly, jitted and transformed),
what each rank's input looks like, what each rank gets back (in terms of
``rank``, ``size`` and the ranks' inputs), which MPI calls the debug log shows,
which FFI targets its lowering uses and which transformations apply. Tests
parametrise over :data:`OPERATIONS` (or a filter of it) instead of keeping
lists of their own, and ``test_operations.py`` fails when an FFI target of
``jaxcomm/kernels/ops.def`` or a public ``JaxComm`` method is in no row.

Adding an operation to the tests is adding its row here; a nonblocking
collective, for example::

    Operation(
        "ireduce",
        family="nonblocking",
        kind="nonblocking",
        call=lambda jc, x: jc.wait(jc.ireduce(x, root=_last(jc))),
        shape=_block,
        expected=_rooted(_sum),
        mpi=("MPI_Ireduce", "MPI_Wait"),
        targets=("ireduce", "wait_exchange"),
        methods=("ireduce", "wait"),
        transforms=NONBLOCKING,
    ),
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import pytest
from mpi4py import MPI

# Transformations a row may support; a test of one filters on it.
JIT, VMAP, JVP, GRAD, TRANSPOSE, SCAN, COND = (
    "jit",
    "vmap",
    "jvp",
    "grad",
    "transpose",
    "scan",
    "cond",
)
ALL = frozenset({JIT, VMAP, JVP, GRAD, TRANSPOSE, SCAN, COND})
NONLINEAR = ALL - {TRANSPOSE}
NOT_DIFFERENTIABLE = ALL - {JVP, GRAD, TRANSPOSE}
NONBLOCKING = ALL

# Kinds of operation: every rank gets a result of its own making; one rank
# sends or receives for all; counts per rank (*v); point-to-point; a
# nonblocking start completed by a wait.
KINDS = ("collective", "rooted", "v", "p2p", "nonblocking")

ROWS = 2  # rows of a block per rank, where an operation moves blocks


@dataclass(frozen=True)
class Operation:
    """One row of the table.

    Attributes:
        id: the test id, ``<method>`` or ``<method>-<variant>``.
        family: the ``jaxcomm.ops`` module whose primitives it binds.
        kind: one of :data:`KINDS`.
        call: ``call(jc, x)``, this rank's result for this rank's input ``x``.
        shape: ``shape(size, rank)``, the shape of ``rank``'s input.
        expected: ``expected(data, rank, size)``, ``rank``'s result as NumPy,
            where ``data(r)`` is rank ``r``'s input.
        mpi: the MPI calls the ``JAXCOMM_DEBUG`` log shows for one call.
        targets: the FFI targets (``jaxcomm_`` left off) the lowering calls.
        methods: the public ``JaxComm`` methods ``call`` uses.
        transforms: the transformations that apply (of :data:`ALL`).
        linear: whether the result is linear in the inputs.
        replicated: whether the result is the same on every rank.
        grid: whether ``call`` needs a Cartesian ``JaxComm``.
        in_place: whether the lowering gives the result the input's buffer
            (the MPI call's in-place form).
        pytree: whether ``call`` takes a pytree of arrays for ``x`` (its
            leaves packed into one MPI call per dtype).
    """

    id: str
    family: str
    kind: str
    call: Callable[[Any, Any], Any]
    shape: Callable[[int, int], tuple[int, ...]]
    expected: Callable[[Callable[[int], np.ndarray], int, int], np.ndarray]
    mpi: tuple[str, ...]
    targets: tuple[str, ...]
    methods: tuple[str, ...] = ()
    transforms: frozenset = ALL
    linear: bool = True
    replicated: bool = False
    grid: bool = False
    in_place: bool = False
    pytree: bool = False

    @property
    def method(self):
        """The ``JaxComm`` method the row is about."""
        return self.id.split("-")[0].split("/")[0]

    def __post_init__(self):
        assert self.kind in KINDS, self.kind
        assert self.transforms <= ALL, self.transforms
        if not self.methods:
            object.__setattr__(self, "methods", (self.method,))


# Arguments, in terms of size and rank -----------------------------------------


def counts(size):
    """Uneven rows per rank for the *v operations, none on some ranks."""
    return [(r + 1) % 3 for r in range(size)]


def matrix(size):
    """Rows rank i sends rank j in ``alltoallv``, none for some pairs."""
    return [[(2 * i + j) % 3 for j in range(size)] for i in range(size)]


def ragged(size, seed=0):
    """A ``ragged_all_to_all`` pattern: ``(rows, out_rows, args)``, ``args[r]`` rank r's index arrays.

    Random, the same on every rank for one ``seed``: blocks of 0 to 3 rows
    (empty ones, self-sends, and for 2 ranks or more a rank that sends
    nothing), taken from ``rows`` rows with gaps between them and written into
    ``out_rows`` rows in a random order of the senders, with gaps.
    ``args[r]`` is ``(input_offsets, send_sizes, output_offsets, recv_sizes)``.
    """
    rng = np.random.default_rng([28, seed, size])
    sizes = rng.integers(0, 4, (size, size))
    sizes[rng.integers(size)] = 0 if size > 1 else sizes[0]
    gaps = rng.integers(0, 2, (size, size))
    input_offsets = np.cumsum(sizes + gaps, axis=1) - sizes
    output_offsets = np.zeros((size, size), np.int64)
    for receiver in range(size):
        at = 0
        for sender in rng.permutation(size):
            at += rng.integers(0, 2)
            output_offsets[sender, receiver] = at
            at += sizes[sender, receiver]
    rows = int((sizes + gaps).sum(axis=1).max())
    out_rows = int(output_offsets.max() + sizes.max() + 1)
    args = [
        (input_offsets[r], sizes[r], output_offsets[r], sizes[:, r].copy()) for r in range(size)
    ]
    return rows, out_rows, args


def ragged_model(operands, outputs, args):
    """Every rank's ``ragged_all_to_all`` result, as NumPy."""
    results = [np.array(o, copy=True) for o in outputs]
    for sender, (input_offsets, send_sizes, output_offsets, _) in enumerate(args):
        for receiver, rows in enumerate(send_sizes):
            start, at = input_offsets[receiver], output_offsets[receiver]
            results[receiver][at : at + rows] = operands[sender][start : start + rows]
    return results


def ring(rank, size):
    """``(source, dest)`` around a periodic ring."""
    return (rank - 1) % size, (rank + 1) % size


def chain(rank, size):
    """``(source, dest)`` along an open chain: ``MPI.PROC_NULL`` at the ends."""
    source = rank - 1 if rank > 0 else MPI.PROC_NULL
    dest = rank + 1 if rank + 1 < size else MPI.PROC_NULL
    return source, dest


def _last(jc):
    return jc.size - 1


def _block(size, rank):
    return (ROWS, 3)


def _one_per_rank(size, rank):
    return (size, ROWS)


def _blocks_per_rank(size, rank):
    return (ROWS * size, ROWS)


def _own_count(size, rank):
    return (counts(size)[rank], ROWS)


def _all_counts(size, rank):
    return (sum(counts(size)), ROWS)


def _row_of_matrix(size, rank):
    return (sum(matrix(size)[rank]), ROWS)


# Expected results -------------------------------------------------------------


def _reduced(fold):
    return lambda data, rank, size: fold([data(r) for r in range(size)])


def _sum(arrays):
    return np.sum(arrays, axis=0)


def _max(arrays):
    return np.max(arrays, axis=0)


def _min(arrays):
    return np.min(arrays, axis=0)


def _prod(arrays):
    return np.prod(arrays, axis=0)


def _rooted(fold, root=lambda size: size - 1):
    """``fold`` on root, zeros of its shape elsewhere."""

    def expected(data, rank, size):
        result = fold([data(r) for r in range(size)])
        return result if rank == root(size) else np.zeros_like(result)

    return expected


def _prefix(fold, inclusive=True):
    def expected(data, rank, size):
        upto = rank + 1 if inclusive else rank
        if upto == 0:
            return np.zeros_like(data(rank))
        return fold([data(r) for r in range(upto)])

    return expected


def _block_of(x, rank, size):
    rows = x.shape[0] // size
    return x[rows * rank : rows * (rank + 1)]


def _reduce_scatter(tiled):
    def expected(data, rank, size):
        total = _sum([data(r) for r in range(size)])
        return _block_of(total, rank, size) if tiled else total[rank]

    return expected


def _root_data(root=lambda size: size - 1):
    return lambda data, rank, size: data(root(size))


def _stack(arrays):
    return np.stack(arrays)


def _concatenate(arrays):
    return np.concatenate(arrays)


def _scatter(tiled, root=lambda size: size - 1):
    def expected(data, rank, size):
        x = data(root(size))
        return _block_of(x, rank, size) if tiled else x[rank]

    return expected


def _alltoall(tiled):
    def expected(data, rank, size):
        blocks = [
            _block_of(data(r), rank, size) if tiled else data(r)[rank][None] for r in range(size)
        ]
        return np.concatenate(blocks)

    return expected


def _scatterv(data, rank, size):
    start = sum(counts(size)[:rank])
    return data(size - 1)[start : start + counts(size)[rank]]


def _alltoallv(data, rank, size):
    m = matrix(size)
    parts = []
    for r in range(size):
        start = sum(m[r][:rank])
        parts.append(data(r)[start : start + m[r][rank]])
    return np.concatenate(parts)


def _ragged_args(jc, x):
    """This rank's output and index arrays of the :func:`ragged` pattern, for operand ``x``."""
    _, out_rows, args = ragged(jc.size)
    output = jax.numpy.zeros((out_rows, *x.shape[1:]), x.dtype)
    return (output, *(a.astype(np.int32) for a in args[jc.rank]))


def _ragged_call(jc, x):
    return jc.ragged_all_to_all(x, *_ragged_args(jc, x))


def _iragged_call(jc, x):
    return jc.wait(jc.iragged_all_to_all(x, *_ragged_args(jc, x)))


def _ragged_shape(size, rank):
    return (ragged(size)[0], ROWS)


def _ragged(data, rank, size):
    _, out_rows, args = ragged(size)
    operands = [data(r) for r in range(size)]
    outputs = [np.zeros((out_rows, *o.shape[1:]), o.dtype) for o in operands]
    return ragged_model(operands, outputs, args)[rank]


def _capacity(size):
    """Rows enough for any rank's receives in ``alltoallv`` of :func:`matrix`."""
    m = matrix(size)
    return max(sum(row[r] for row in m) for r in range(size))


def _alltoallv_learned(jc, x):
    y, received = jc.alltoallv(x, matrix(jc.size)[jc.rank], capacity=_capacity(jc.size))
    return y


def _alltoallv_traced(jc, x):
    # Counts computed inside the function, so traced under jit (and, not
    # depending on x, the same for every member of a vmap batch).
    counts = jax.numpy.asarray(matrix(jc.size))[jax.numpy.int32(jc.rank)]
    return jc.alltoallv(x, counts, capacity=_capacity(jc.size))[0]


def _alltoallv_recvcounts(jc, x):
    m = matrix(jc.size)
    return jc.alltoallv(x, m[jc.rank], [row[jc.rank] for row in m])


def _ialltoallv_learned(jc, x):
    y, received = jc.wait(jc.ialltoallv(x, matrix(jc.size)[jc.rank], capacity=_capacity(jc.size)))
    return y


def _ialltoallv_traced(jc, x):
    # Both counts computed inside the function, so traced under jit.
    m = jax.numpy.asarray(matrix(jc.size))
    send, recv = m[jax.numpy.int32(jc.rank)], m[:, jax.numpy.int32(jc.rank)]
    return jc.wait(jc.ialltoallv(x, send, recv, capacity=_capacity(jc.size)))


def _alltoallv_padded(data, rank, size):
    got = _alltoallv(data, rank, size)
    capacity = _capacity(size)
    padding = np.zeros((capacity - got.shape[0], *got.shape[1:]), got.dtype)
    return np.concatenate([got, padding])


def _from_left(data, rank, size):
    return data(ring(rank, size)[0])


# Neighbourhood collectives on the periodic one-axis grid: the neighbours are
# the rank behind, then the rank ahead.


def _neighbor_blocks(size, rank):
    return (2, ROWS, 3)


def _neighbor_alltoall(data, rank, size):
    behind, ahead = ring(rank, size)
    return np.stack([data(behind)[1], data(ahead)[0]])


def _neighbor_allgather(data, rank, size):
    behind, ahead = ring(rank, size)
    return np.stack([data(behind), data(ahead)])


def _neighbor_alltoallv_call(jc, x):
    # One row back, two ahead; two arrive from behind, one from ahead.
    return jc.neighbor_alltoallv(x, [1, 2], [2, 1])


def _ineighbor_alltoallv_call(jc, x):
    return jc.wait(jc.ineighbor_alltoallv(x, [1, 2], [2, 1]))


def _ineighbor_alltoallv_learned(jc, x):
    # Counts computed inside the function (traced under jit), the receive
    # counts learned.
    y, received = jc.wait(jc.ineighbor_alltoallv(x, jax.numpy.array([1, 2]), capacity=3))
    return y


def _neighbor_alltoallv_shape(size, rank):
    return (3, ROWS)


def _neighbor_alltoallv(data, rank, size):
    behind, ahead = ring(rank, size)
    return np.concatenate([data(behind)[1:3], data(ahead)[:1]])


def _around(jc):
    """The rows the ranks behind and ahead on the ring send in the allgatherv rows."""
    behind, ahead = ring(jc.rank, jc.size)
    return [counts(jc.size)[behind], counts(jc.size)[ahead]]


def _neighbor_allgatherv_call(jc, x):
    return jc.neighbor_allgatherv(x, _around(jc))


def _neighbor_allgatherv_learned(jc, x):
    # The send count computed inside the function (traced under jit), the
    # receive counts learned.
    y, received = jc.neighbor_allgatherv(
        x, sendcount=jax.numpy.int32(x.shape[0]), capacity=sum(_around(jc))
    )
    return y


def _ineighbor_allgatherv_call(jc, x):
    return jc.wait(jc.ineighbor_allgatherv(x, _around(jc)))


def _ineighbor_allgatherv_learned(jc, x):
    y, received = jc.wait(jc.ineighbor_allgatherv(x, capacity=sum(_around(jc))))
    return y


def _neighbor_allgatherv(data, rank, size):
    behind, ahead = ring(rank, size)
    return np.concatenate([data(behind), data(ahead)])


def _from_chain(data, rank, size):
    source, _ = chain(rank, size)
    return data(source) if source != MPI.PROC_NULL else np.zeros_like(data(rank))


def _own(data, rank, size):
    return data(rank)


# Calls that need more than one line -------------------------------------------


def _send_recv(jc, x):
    source, dest = chain(jc.rank, jc.size)
    jc.send(x, dest)
    return jc.recv(x, source, tag=0)


def _isend_irecv(jc, x):
    source, dest = chain(jc.rank, jc.size)
    received, _ = jc.waitall([jc.irecv(x, source=source, tag=0), jc.isend(x, dest)])
    return received


def _barrier(jc, x):
    jc.barrier()
    return x


def _allgatherv(jc, x):
    return jc.allgatherv(x, counts(jc.size))


def _gatherv(jc, x):
    return jc.gatherv(x, counts(jc.size), root=0)


def _scatterv_call(jc, x):
    return jc.scatterv(x, counts(jc.size), root=_last(jc))


def _alltoallv_call(jc, x):
    return jc.alltoallv(x, matrix(jc.size))


def _ialltoallv(jc, x):
    m = matrix(jc.size)
    return jc.wait(jc.ialltoallv(x, m[jc.rank], [row[jc.rank] for row in m]))


def _sendrecv(jc, x):
    return jc.sendrecv(x, x, *ring(jc.rank, jc.size), recvtag=0)


# The table --------------------------------------------------------------------

_FIRST = lambda size: 0  # noqa: E731

OPERATIONS = (
    Operation(
        "allreduce",
        family="reduction",
        kind="collective",
        call=lambda jc, x: jc.allreduce(x),
        shape=_block,
        expected=_reduced(_sum),
        mpi=("MPI_Allreduce",),
        targets=("allreduce",),
        replicated=True,
        in_place=True,
        pytree=True,
    ),
    Operation(
        "allreduce-MAX",
        family="reduction",
        kind="collective",
        call=lambda jc, x: jc.allreduce(x, op=MPI.MAX),
        shape=_block,
        expected=_reduced(_max),
        mpi=("MPI_Allreduce",),
        targets=("allreduce",),
        transforms=NONLINEAR,
        linear=False,
        replicated=True,
        in_place=True,
        pytree=True,
    ),
    Operation(
        "allreduce-MIN",
        family="reduction",
        kind="collective",
        call=lambda jc, x: jc.allreduce(x, op=MPI.MIN),
        shape=_block,
        expected=_reduced(_min),
        mpi=("MPI_Allreduce",),
        targets=("allreduce",),
        transforms=NONLINEAR,
        linear=False,
        replicated=True,
        in_place=True,
        pytree=True,
    ),
    Operation(
        "allreduce-PROD",
        family="reduction",
        kind="collective",
        call=lambda jc, x: jc.allreduce(x, op=MPI.PROD),
        shape=_block,
        expected=_reduced(_prod),
        mpi=("MPI_Allreduce",),
        targets=("allreduce",),
        transforms=NONLINEAR,
        linear=False,
        replicated=True,
        in_place=True,
        pytree=True,
    ),
    Operation(
        "reduce",
        family="reduction",
        kind="rooted",
        call=lambda jc, x: jc.reduce(x, root=_last(jc)),
        shape=_block,
        expected=_rooted(_sum),
        mpi=("MPI_Reduce",),
        targets=("reduce",),
        in_place=True,
        pytree=True,
    ),
    Operation(
        "reduce-MIN",
        family="reduction",
        kind="rooted",
        call=lambda jc, x: jc.reduce(x, op=MPI.MIN, root=0),
        shape=_block,
        expected=_rooted(_min, root=_FIRST),
        mpi=("MPI_Reduce",),
        targets=("reduce",),
        transforms=NONLINEAR,
        linear=False,
        in_place=True,
        pytree=True,
    ),
    Operation(
        "scan",
        family="reduction",
        kind="collective",
        call=lambda jc, x: jc.scan(x),
        shape=_block,
        expected=_prefix(_sum),
        mpi=("MPI_Scan",),
        targets=("scan",),
        in_place=True,
    ),
    Operation(
        "scan-PROD",
        family="reduction",
        kind="collective",
        call=lambda jc, x: jc.scan(x, op=MPI.PROD),
        shape=_block,
        expected=_prefix(_prod),
        mpi=("MPI_Scan",),
        targets=("scan",),
        transforms=NOT_DIFFERENTIABLE,
        linear=False,
        in_place=True,
    ),
    Operation(
        "exscan",
        family="reduction",
        kind="collective",
        call=lambda jc, x: jc.exscan(x),
        shape=_block,
        expected=_prefix(_sum, inclusive=False),
        mpi=("MPI_Exscan",),
        targets=("exscan",),
        in_place=True,
    ),
    Operation(
        "reduce_scatter",
        family="reduction",
        kind="collective",
        call=lambda jc, x: jc.reduce_scatter(x),
        shape=_one_per_rank,
        expected=_reduce_scatter(tiled=False),
        mpi=("MPI_Reduce_scatter_block",),
        targets=("reduce_scatter",),
    ),
    Operation(
        "reduce_scatter-tiled",
        family="reduction",
        kind="collective",
        call=lambda jc, x: jc.reduce_scatter(x, tiled=True),
        shape=_blocks_per_rank,
        expected=_reduce_scatter(tiled=True),
        mpi=("MPI_Reduce_scatter_block",),
        targets=("reduce_scatter",),
    ),
    Operation(
        "bcast",
        family="bcast",
        kind="rooted",
        call=lambda jc, x: jc.bcast(x, root=_last(jc)),
        shape=_block,
        expected=_root_data(),
        mpi=("MPI_Bcast",),
        targets=("bcast",),
        replicated=True,
        in_place=True,
        pytree=True,
    ),
    Operation(
        "barrier",
        family="barrier",
        kind="collective",
        call=_barrier,
        shape=_block,
        expected=_own,
        mpi=("MPI_Barrier",),
        targets=("barrier",),
    ),
    Operation(
        "allgather",
        family="gather",
        kind="collective",
        call=lambda jc, x: jc.allgather(x),
        shape=_block,
        expected=_reduced(_stack),
        mpi=("MPI_Allgather",),
        targets=("allgather",),
        replicated=True,
        pytree=True,
    ),
    Operation(
        "allgather-tiled",
        family="gather",
        kind="collective",
        call=lambda jc, x: jc.allgather(x, tiled=True),
        shape=_block,
        expected=_reduced(_concatenate),
        mpi=("MPI_Allgather",),
        targets=("allgather",),
        replicated=True,
        pytree=True,
    ),
    Operation(
        "gather",
        family="gather",
        kind="rooted",
        call=lambda jc, x: jc.gather(x, root=_last(jc)),
        shape=_block,
        expected=_rooted(_stack),
        mpi=("MPI_Gather",),
        targets=("gather",),
        pytree=True,
    ),
    Operation(
        "gather-tiled",
        family="gather",
        kind="rooted",
        call=lambda jc, x: jc.gather(x, root=0, tiled=True),
        shape=_block,
        expected=_rooted(_concatenate, root=_FIRST),
        mpi=("MPI_Gather",),
        targets=("gather",),
        pytree=True,
    ),
    Operation(
        "scatter",
        family="gather",
        kind="rooted",
        call=lambda jc, x: jc.scatter(x, root=_last(jc)),
        shape=_one_per_rank,
        expected=_scatter(tiled=False),
        mpi=("MPI_Scatter",),
        targets=("scatter",),
    ),
    Operation(
        "scatter-tiled",
        family="gather",
        kind="rooted",
        call=lambda jc, x: jc.scatter(x, root=0, tiled=True),
        shape=_blocks_per_rank,
        expected=_scatter(tiled=True, root=_FIRST),
        mpi=("MPI_Scatter",),
        targets=("scatter",),
    ),
    Operation(
        "alltoall",
        family="gather",
        kind="collective",
        call=lambda jc, x: jc.alltoall(x),
        shape=_one_per_rank,
        expected=_alltoall(tiled=False),
        mpi=("MPI_Alltoall",),
        targets=("alltoall",),
    ),
    Operation(
        "alltoall-tiled",
        family="gather",
        kind="collective",
        call=lambda jc, x: jc.alltoall(x, tiled=True),
        shape=_blocks_per_rank,
        expected=_alltoall(tiled=True),
        mpi=("MPI_Alltoall",),
        targets=("alltoall",),
    ),
    Operation(
        "allgatherv",
        family="gather",
        kind="v",
        call=_allgatherv,
        shape=_own_count,
        expected=_reduced(_concatenate),
        mpi=("MPI_Allgatherv",),
        targets=("allgatherv",),
        replicated=True,
    ),
    Operation(
        "gatherv",
        family="gather",
        kind="v",
        call=_gatherv,
        shape=_own_count,
        expected=_rooted(_concatenate, root=_FIRST),
        mpi=("MPI_Gatherv",),
        targets=("gatherv",),
    ),
    Operation(
        "scatterv",
        family="gather",
        kind="v",
        call=_scatterv_call,
        shape=_all_counts,
        expected=_scatterv,
        mpi=("MPI_Scatterv",),
        targets=("scatterv",),
    ),
    Operation(
        "alltoallv",
        family="gather",
        kind="v",
        call=_alltoallv_call,
        shape=_row_of_matrix,
        expected=_alltoallv,
        mpi=("MPI_Alltoallv",),
        targets=("alltoallv",),
    ),
    Operation(
        "alltoallv-learned",
        family="ragged",
        kind="v",
        call=_alltoallv_learned,
        shape=_row_of_matrix,
        expected=_alltoallv_padded,
        mpi=("MPI_Alltoall", "MPI_Alltoallv"),
        targets=("alltoallv_counts",),
    ),
    Operation(
        "alltoallv-traced",
        family="ragged",
        kind="v",
        call=_alltoallv_traced,
        shape=_row_of_matrix,
        expected=_alltoallv_padded,
        mpi=("MPI_Alltoall", "MPI_Alltoallv"),
        targets=("alltoallv_counts",),
    ),
    Operation(
        "alltoallv-recvcounts",
        family="ragged",
        kind="v",
        call=_alltoallv_recvcounts,
        shape=_row_of_matrix,
        expected=_alltoallv,
        mpi=("MPI_Alltoall", "MPI_Alltoallv"),
        targets=("alltoallv_counts",),
    ),
    Operation(
        "ragged_all_to_all",
        family="ragged",
        kind="v",
        call=_ragged_call,
        shape=_ragged_shape,
        expected=_ragged,
        mpi=("MPI_Alltoall", "MPI_Alltoallv"),
        targets=("ragged_all_to_all",),
    ),
    Operation(
        "sendrecv",
        family="p2p",
        kind="p2p",
        call=_sendrecv,
        shape=_block,
        expected=_from_left,
        mpi=("MPI_Sendrecv",),
        targets=("sendrecv",),
    ),
    Operation(
        "send/recv",
        family="p2p",
        kind="p2p",
        call=_send_recv,
        shape=_block,
        expected=_from_chain,
        mpi=("MPI_Send", "MPI_Recv"),
        targets=("send", "recv"),
        methods=("send", "recv"),
    ),
    Operation(
        "neighbor_alltoall",
        family="neighbor",
        kind="collective",
        call=lambda jc, x: jc.neighbor_alltoall(x),
        shape=_neighbor_blocks,
        expected=_neighbor_alltoall,
        mpi=("MPI_Neighbor_alltoall",),
        targets=("neighbor_alltoall",),
        grid=True,
    ),
    Operation(
        "neighbor_allgather",
        family="neighbor",
        kind="collective",
        call=lambda jc, x: jc.neighbor_allgather(x),
        shape=_block,
        expected=_neighbor_allgather,
        mpi=("MPI_Neighbor_allgather",),
        targets=("neighbor_allgather",),
        grid=True,
    ),
    Operation(
        "neighbor_alltoallv",
        family="neighbor",
        kind="v",
        call=_neighbor_alltoallv_call,
        shape=_neighbor_alltoallv_shape,
        expected=_neighbor_alltoallv,
        mpi=("MPI_Neighbor_alltoall", "MPI_Neighbor_alltoallv"),
        targets=("neighbor_alltoallv",),
        grid=True,
    ),
    Operation(
        "neighbor_allgatherv",
        family="neighbor",
        kind="v",
        call=_neighbor_allgatherv_call,
        shape=_own_count,
        expected=_neighbor_allgatherv,
        mpi=("MPI_Neighbor_alltoall", "MPI_Neighbor_allgatherv"),
        targets=("neighbor_allgatherv",),
        grid=True,
    ),
    Operation(
        "neighbor_allgatherv-learned",
        family="neighbor",
        kind="v",
        call=_neighbor_allgatherv_learned,
        shape=_own_count,
        expected=_neighbor_allgatherv,
        mpi=("MPI_Neighbor_alltoall", "MPI_Neighbor_allgatherv"),
        targets=("neighbor_allgatherv",),
        grid=True,
    ),
    Operation(
        "shift",
        family="p2p",
        kind="p2p",
        call=lambda jc, x: jc.shift(x, direction=0),
        shape=_block,
        expected=_from_left,
        mpi=("MPI_Sendrecv",),
        targets=("sendrecv",),
        grid=True,
    ),
    Operation(
        "isend/irecv",
        family="nonblocking",
        kind="nonblocking",
        call=_isend_irecv,
        shape=_block,
        expected=_from_chain,
        mpi=("MPI_Irecv", "MPI_Isend", "MPI_Wait", "MPI_Wait"),
        targets=("irecv", "isend", "wait_recv", "wait_send"),
        methods=("isend", "irecv", "waitall"),
        transforms=NONBLOCKING,
    ),
    Operation(
        "iallreduce",
        family="nonblocking",
        kind="nonblocking",
        call=lambda jc, x: jc.wait(jc.iallreduce(x)),
        shape=_block,
        expected=_reduced(_sum),
        mpi=("MPI_Iallreduce", "MPI_Wait"),
        targets=("iallreduce", "wait_exchange"),
        methods=("iallreduce", "wait"),
        replicated=True,
        transforms=NONBLOCKING,
    ),
    Operation(
        "ireduce",
        family="nonblocking",
        kind="nonblocking",
        call=lambda jc, x: jc.wait(jc.ireduce(x, root=_last(jc))),
        shape=_block,
        expected=_rooted(_sum),
        mpi=("MPI_Ireduce", "MPI_Wait"),
        targets=("ireduce", "wait_exchange"),
        methods=("ireduce", "wait"),
        transforms=NONBLOCKING,
    ),
    Operation(
        "ireduce-MAX",
        family="nonblocking",
        kind="nonblocking",
        call=lambda jc, x: jc.wait(jc.ireduce(x, op=MPI.MAX, root=0)),
        shape=_block,
        expected=_rooted(_max, root=_FIRST),
        mpi=("MPI_Ireduce", "MPI_Wait"),
        targets=("ireduce", "wait_exchange"),
        methods=("ireduce", "wait"),
        transforms=NONBLOCKING - {TRANSPOSE},
        linear=False,
    ),
    Operation(
        "iscan",
        family="nonblocking",
        kind="nonblocking",
        call=lambda jc, x: jc.wait(jc.iscan(x)),
        shape=_block,
        expected=_prefix(_sum),
        mpi=("MPI_Iscan", "MPI_Wait"),
        targets=("iscan", "wait_exchange"),
        methods=("iscan", "wait"),
        transforms=NONBLOCKING,
    ),
    Operation(
        "iscan-PROD",
        family="nonblocking",
        kind="nonblocking",
        call=lambda jc, x: jc.wait(jc.iscan(x, op=MPI.PROD)),
        shape=_block,
        expected=_prefix(_prod),
        mpi=("MPI_Iscan", "MPI_Wait"),
        targets=("iscan", "wait_exchange"),
        methods=("iscan", "wait"),
        transforms=NOT_DIFFERENTIABLE,
        linear=False,
    ),
    Operation(
        "ibcast",
        family="nonblocking",
        kind="nonblocking",
        call=lambda jc, x: jc.wait(jc.ibcast(x, root=_last(jc))),
        shape=_block,
        expected=_root_data(),
        mpi=("MPI_Ibcast", "MPI_Wait"),
        targets=("ibcast", "wait_exchange"),
        methods=("ibcast", "wait"),
        replicated=True,
        transforms=NONBLOCKING,
    ),
    Operation(
        "iallgather",
        family="nonblocking",
        kind="nonblocking",
        call=lambda jc, x: jc.wait(jc.iallgather(x)),
        shape=_block,
        expected=_reduced(_stack),
        mpi=("MPI_Iallgather", "MPI_Wait"),
        targets=("iallgather", "wait_exchange"),
        methods=("iallgather", "wait"),
        replicated=True,
        transforms=NONBLOCKING,
    ),
    Operation(
        "igather",
        family="nonblocking",
        kind="nonblocking",
        call=lambda jc, x: jc.wait(jc.igather(x, root=_last(jc))),
        shape=_block,
        expected=_rooted(_stack),
        mpi=("MPI_Igather", "MPI_Wait"),
        targets=("igather", "wait_exchange"),
        methods=("igather", "wait"),
        transforms=NONBLOCKING,
    ),
    Operation(
        "igather-tiled",
        family="nonblocking",
        kind="nonblocking",
        call=lambda jc, x: jc.wait(jc.igather(x, root=0, tiled=True)),
        shape=_block,
        expected=_rooted(_concatenate, root=_FIRST),
        mpi=("MPI_Igather", "MPI_Wait"),
        targets=("igather", "wait_exchange"),
        methods=("igather", "wait"),
        transforms=NONBLOCKING,
    ),
    Operation(
        "iscatter",
        family="nonblocking",
        kind="nonblocking",
        call=lambda jc, x: jc.wait(jc.iscatter(x, root=_last(jc))),
        shape=_one_per_rank,
        expected=_scatter(tiled=False),
        mpi=("MPI_Iscatter", "MPI_Wait"),
        targets=("iscatter", "wait_exchange"),
        methods=("iscatter", "wait"),
        transforms=NONBLOCKING,
    ),
    Operation(
        "iscatter-tiled",
        family="nonblocking",
        kind="nonblocking",
        call=lambda jc, x: jc.wait(jc.iscatter(x, root=0, tiled=True)),
        shape=_blocks_per_rank,
        expected=_scatter(tiled=True, root=_FIRST),
        mpi=("MPI_Iscatter", "MPI_Wait"),
        targets=("iscatter", "wait_exchange"),
        methods=("iscatter", "wait"),
        transforms=NONBLOCKING,
    ),
    Operation(
        "ialltoallv",
        family="nonblocking",
        kind="nonblocking",
        call=_ialltoallv,
        shape=_row_of_matrix,
        expected=_alltoallv,
        mpi=("MPI_Ialltoallv", "MPI_Wait"),
        targets=("ialltoallv", "wait_exchange"),
        methods=("ialltoallv", "wait"),
        transforms=NONBLOCKING,
    ),
    Operation(
        "ialltoallv-learned",
        family="nonblocking",
        kind="nonblocking",
        call=_ialltoallv_learned,
        shape=_row_of_matrix,
        expected=_alltoallv_padded,
        mpi=("MPI_Alltoall", "MPI_Ialltoallv", "MPI_Wait"),
        targets=("ialltoallv_counts", "wait_ragged"),
        methods=("ialltoallv", "wait"),
        transforms=NONBLOCKING,
    ),
    Operation(
        "ialltoallv-traced",
        family="nonblocking",
        kind="nonblocking",
        call=_ialltoallv_traced,
        shape=_row_of_matrix,
        expected=_alltoallv_padded,
        mpi=("MPI_Alltoall", "MPI_Ialltoallv", "MPI_Wait"),
        targets=("ialltoallv_counts", "wait_ragged"),
        methods=("ialltoallv", "wait"),
        transforms=NONBLOCKING,
    ),
    Operation(
        "iragged_all_to_all",
        family="nonblocking",
        kind="nonblocking",
        call=_iragged_call,
        shape=_ragged_shape,
        expected=_ragged,
        mpi=("MPI_Alltoall", "MPI_Ialltoallv", "MPI_Wait"),
        targets=("iragged_all_to_all", "wait_ragged"),
        methods=("iragged_all_to_all", "wait"),
        transforms=NONBLOCKING,
    ),
    Operation(
        "ialltoall",
        family="nonblocking",
        kind="nonblocking",
        call=lambda jc, x: jc.wait(jc.ialltoall(x, tiled=True)),
        shape=_blocks_per_rank,
        expected=_alltoall(tiled=True),
        mpi=("MPI_Ialltoall", "MPI_Wait"),
        targets=("ialltoall", "wait_exchange"),
        methods=("ialltoall", "wait"),
        transforms=NONBLOCKING,
    ),
    Operation(
        "ineighbor_alltoall",
        family="nonblocking",
        kind="nonblocking",
        call=lambda jc, x: jc.wait(jc.ineighbor_alltoall(x)),
        shape=_neighbor_blocks,
        expected=_neighbor_alltoall,
        mpi=("MPI_Ineighbor_alltoall", "MPI_Wait"),
        targets=("ineighbor_alltoall", "wait_exchange"),
        methods=("ineighbor_alltoall", "wait"),
        transforms=NONBLOCKING,
        grid=True,
    ),
    Operation(
        "ineighbor_alltoallv",
        family="nonblocking",
        kind="nonblocking",
        call=_ineighbor_alltoallv_call,
        shape=_neighbor_alltoallv_shape,
        expected=_neighbor_alltoallv,
        mpi=("MPI_Neighbor_alltoall", "MPI_Ineighbor_alltoallv", "MPI_Wait"),
        targets=("ineighbor_alltoallv", "wait_ragged"),
        methods=("ineighbor_alltoallv", "wait"),
        transforms=NONBLOCKING,
        grid=True,
    ),
    Operation(
        "ineighbor_alltoallv-learned",
        family="nonblocking",
        kind="nonblocking",
        call=_ineighbor_alltoallv_learned,
        shape=_neighbor_alltoallv_shape,
        expected=_neighbor_alltoallv,
        mpi=("MPI_Neighbor_alltoall", "MPI_Ineighbor_alltoallv", "MPI_Wait"),
        targets=("ineighbor_alltoallv", "wait_ragged"),
        methods=("ineighbor_alltoallv", "wait"),
        transforms=NONBLOCKING,
        grid=True,
    ),
    Operation(
        "ineighbor_allgatherv",
        family="nonblocking",
        kind="nonblocking",
        call=_ineighbor_allgatherv_call,
        shape=_own_count,
        expected=_neighbor_allgatherv,
        mpi=("MPI_Neighbor_alltoall", "MPI_Ineighbor_allgatherv", "MPI_Wait"),
        targets=("ineighbor_allgatherv", "wait_ragged"),
        methods=("ineighbor_allgatherv", "wait"),
        transforms=NONBLOCKING,
        grid=True,
    ),
    Operation(
        "ineighbor_allgatherv-learned",
        family="nonblocking",
        kind="nonblocking",
        call=_ineighbor_allgatherv_learned,
        shape=_own_count,
        expected=_neighbor_allgatherv,
        mpi=("MPI_Neighbor_alltoall", "MPI_Ineighbor_allgatherv", "MPI_Wait"),
        targets=("ineighbor_allgatherv", "wait_ragged"),
        methods=("ineighbor_allgatherv", "wait"),
        transforms=NONBLOCKING,
        grid=True,
    ),
    Operation(
        "ineighbor_allgather",
        family="nonblocking",
        kind="nonblocking",
        call=lambda jc, x: jc.wait(jc.ineighbor_allgather(x)),
        shape=_block,
        expected=_neighbor_allgather,
        mpi=("MPI_Ineighbor_allgather", "MPI_Wait"),
        targets=("ineighbor_allgather", "wait_exchange"),
        methods=("ineighbor_allgather", "wait"),
        transforms=NONBLOCKING,
        grid=True,
    ),
)

BY_ID = {op.id: op for op in OPERATIONS}
assert len(BY_ID) == len(OPERATIONS), "two rows share an id"


@dataclass(frozen=True)
class Internal:
    """An FFI target that is no operation of its own, and the row that uses it.

    Attributes:
        row: the id of the row whose operation uses the target.
        why: when it does.
        call: ``call(jc, x)``, a use of the row's operation whose lowering
            reaches the target (``x`` of shape ``(2, 3)``).
    """

    row: str
    why: str
    call: Callable[[Any, Any], Any]


def _recv_with_status(jc, x):
    return jc.recv(x, ring(jc.rank, jc.size)[0], status=MPI.Status())


def _wildcard_tangent(jc, x):
    dest = ring(jc.rank, jc.size)[1]
    return jax.jvp(lambda x: jc.sendrecv(x, x, source=MPI.ANY_SOURCE, dest=dest), (x,), (x,))[1]


def _during(jc, x):
    source, dest = ring(jc.rank, jc.size)
    requests = [jc.irecv(x, source=source), jc.isend(x, dest)]
    y = jc.during(requests, jax.numpy.sin, x)
    return y, jc.waitall(requests)[0]


# FFI targets no row's call lowers to, each mapped to the row that uses it.
INTERNAL_TARGETS = {
    "write_status": Internal("send/recv", "recv(..., status=MPI.Status())", _recv_with_status),
    "sendrecv_addressed": Internal(
        "sendrecv", "the tangent of a receive from MPI.ANY_SOURCE", _wildcard_tangent
    ),
    "fence": Internal("isend/irecv", "JaxComm.during between starts and waits", _during),
}

# Public JaxComm members that move no data, each with what it is.
NOT_COMMUNICATING = {
    "comm": "property: the private mpi4py communicator",
    "rank": "property",
    "size": "property",
    "freed": "property",
    "dims": "property of a Cartesian JaxComm",
    "periods": "property of a Cartesian JaxComm",
    "coords": "property of a Cartesian JaxComm",
    "free": "frees the communicators (MPI_Comm_free, no message of jaxcomm's)",
    "split": "makes a communicator (MPI_Comm_split)",
    "from_cart": "makes a communicator (MPI_Cart_create)",
    "from_graph": "makes a communicator (MPI_Dist_graph_create_adjacent)",
    "for_mesh": "makes a communicator along mesh axes (MPI_Comm_split; tests/test_shard_map.py)",
    "mesh_axes": "property of a JaxComm made by for_mesh",
    "sources": "property of a JaxComm with a topology",
    "destinations": "property of a JaxComm with a topology",
    "cart_shift": "neighbour ranks of a Cartesian grid, no message",
    "during": "orders a computation between starts and waits, no message",
    "sync": "waits for dispatched work, no message",
}


def select(*transforms, grid=False, **properties):
    """The rows that support every one of ``transforms`` and have ``properties``.

    Rows that need a Cartesian ``JaxComm`` are left out unless ``grid`` is None
    (any row) or True (only those).
    """
    return [
        op
        for op in OPERATIONS
        if set(transforms) <= op.transforms
        and (grid is None or op.grid == grid)
        and all(getattr(op, k) == v for k, v in properties.items())
    ]


def ids(operations):
    """pytest ids of rows, without characters that need quoting."""
    return [op.id.replace("/", "-") for op in operations]


def params(operations):
    """``pytest.param`` objects of rows, named by their ids."""
    return [pytest.param(op, id=name) for op, name in zip(operations, ids(operations))]


def rotations(jc):
    """``jc`` with its ranks renumbered ``size`` ways, one after another.

    Rank ``r`` of ``jc`` is rank ``(r + k) % size`` of the ``k``-th, so over
    all of them each process takes each place a row's call names (a root, an
    end of the chain, a rank's count) once. Each is freed before the next is made.
    """
    for k in range(jc.size):
        rotated = jc.split(0, key=(jc.rank + k) % jc.size)
        try:
            yield rotated
        finally:
            rotated.free()


# Counts given every way a program may hold them ---------------------------------


@dataclass(frozen=True)
class Counted:
    """A call that takes counts or index arrays, for the ways a program may give them.

    ``test_operations.py`` gives this rank's counts as Python lists, NumPy
    arrays or JAX arrays, to an eager call, to a jitted function that closes
    over them (concrete values: constants of the trace), and to one that takes
    them as arguments (traced).

    Attributes:
        id: the test id.
        call: ``call(jc, x, *counts)``, this rank's result.
        counts: ``counts(size, rank)``, this rank's counts arguments as lists.
        shape: ``shape(size, rank)``, the shape of ``rank``'s input.
        expected: ``expected(data, rank, size)``, ``rank``'s result, where
            ``data(r)`` is rank ``r``'s input.
        static: whether the counts must be known while tracing; traced
            ones then raise a ``TypeError``.
        grid: whether ``call`` needs a Cartesian ``JaxComm``.
    """

    id: str
    call: Callable[..., Any]
    counts: Callable[[int, int], tuple[Any, ...]]
    shape: Callable[[int, int], tuple[int, ...]]
    expected: Callable[[Callable[[int], np.ndarray], int, int], np.ndarray]
    static: bool = False
    grid: bool = False


def _symmetric(size):
    """Counts where each rank receives as many rows as it sends, none for some pairs.

    So ``x`` holds exactly the rows sent and, by default, the result exactly
    the rows received, whether ``recvcounts`` are static or traced.
    """
    return [[(i + j) % 3 for j in range(size)] for i in range(size)]


def _symmetric_shape(size, rank):
    return (sum(_symmetric(size)[rank]), ROWS)


def _symmetric_exchange(data, rank, size):
    m = _symmetric(size)
    return np.concatenate([data(r)[sum(m[r][:rank]) :][: m[r][rank]] for r in range(size)])


def _own_and_received(size, rank):
    m = _symmetric(size)
    return m[rank], [row[rank] for row in m]


def _ragged_with_counts(name):
    def call(jc, x, *indices):
        output = jax.numpy.zeros((ragged(jc.size)[1], *x.shape[1:]), x.dtype)
        if name == "ragged_all_to_all":
            return jc.ragged_all_to_all(x, output, *indices)
        return jc.wait(jc.iragged_all_to_all(x, output, *indices))

    return call


COUNTED = (
    Counted(
        "allgatherv",
        call=lambda jc, x, c: jc.allgatherv(x, c),
        counts=lambda size, rank: (counts(size),),
        shape=_own_count,
        expected=_reduced(_concatenate),
        static=True,
    ),
    Counted(
        "gatherv",
        call=lambda jc, x, c: jc.gatherv(x, c, root=0),
        counts=lambda size, rank: (counts(size),),
        shape=_own_count,
        expected=_rooted(_concatenate, root=_FIRST),
        static=True,
    ),
    Counted(
        "scatterv",
        call=lambda jc, x, c: jc.scatterv(x, c, root=_last(jc)),
        counts=lambda size, rank: (counts(size),),
        shape=_all_counts,
        expected=_scatterv,
        static=True,
    ),
    Counted(
        "alltoallv-matrix",
        call=lambda jc, x, m: jc.alltoallv(x, m),
        counts=lambda size, rank: (matrix(size),),
        shape=_row_of_matrix,
        expected=_alltoallv,
        static=True,
    ),
    Counted(
        "alltoallv-learned",
        call=lambda jc, x, s: jc.alltoallv(x, s, capacity=_capacity(jc.size))[0],
        counts=lambda size, rank: (matrix(size)[rank],),
        shape=_row_of_matrix,
        expected=_alltoallv_padded,
    ),
    Counted(
        "alltoallv-recvcounts",
        call=lambda jc, x, s, r: jc.alltoallv(x, s, r),
        counts=_own_and_received,
        shape=_symmetric_shape,
        expected=_symmetric_exchange,
    ),
    Counted(
        "ialltoallv-learned",
        call=lambda jc, x, s: jc.wait(jc.ialltoallv(x, s, capacity=_capacity(jc.size)))[0],
        counts=lambda size, rank: (matrix(size)[rank],),
        shape=_row_of_matrix,
        expected=_alltoallv_padded,
    ),
    Counted(
        "ialltoallv-recvcounts",
        call=lambda jc, x, s, r: jc.wait(jc.ialltoallv(x, s, r)),
        counts=_own_and_received,
        shape=_symmetric_shape,
        expected=_symmetric_exchange,
    ),
    Counted(
        "neighbor_alltoallv",
        call=lambda jc, x, s, r: jc.neighbor_alltoallv(x, s, r),
        counts=lambda size, rank: ([1, 2], [2, 1]),
        shape=_neighbor_alltoallv_shape,
        expected=_neighbor_alltoallv,
        grid=True,
    ),
    Counted(
        "ineighbor_alltoallv",
        call=lambda jc, x, s, r: jc.wait(jc.ineighbor_alltoallv(x, s, r)),
        counts=lambda size, rank: ([1, 2], [2, 1]),
        shape=_neighbor_alltoallv_shape,
        expected=_neighbor_alltoallv,
        grid=True,
    ),
    Counted(
        "ragged_all_to_all",
        call=_ragged_with_counts("ragged_all_to_all"),
        counts=lambda size, rank: tuple(a.tolist() for a in ragged(size)[2][rank]),
        shape=_ragged_shape,
        expected=_ragged,
    ),
    Counted(
        "iragged_all_to_all",
        call=_ragged_with_counts("iragged_all_to_all"),
        counts=lambda size, rank: tuple(a.tolist() for a in ragged(size)[2][rank]),
        shape=_ragged_shape,
        expected=_ragged,
    ),
)
