"""The benchmarked operations: what each one does in jaxcomm and in mpi4py, its
message, its check data and its step in loop mode.

An implementation (see :mod:`jaxcomm.bench.routes`) does an :class:`Op` its
own way; the measurement compares every implementation's result with mpi4py's
before timing it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from ..comm import JaxComm

MODES = ("jit", "loop", "eager")
DTYPE = np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class Op:
    """One benchmarked operation and how mpi4py does the same.

    Attributes:
        name: the jaxcomm method's name (``send_recv`` is a ping-pong of
            ``send`` and ``recv``; ``ragged`` is ``alltoallv`` with this
            rank's traced counts, blocks of :func:`ragged_counts` rows, taken
            one after another from the input's first row).
        split: whether the input has a leading axis of the communicator size
            (scatter, alltoall, reduce_scatter); otherwise it is flat.
        out_shape: the output shape, from the input shape and the size.
        jaxcomm: ``(JaxComm, x) -> y``, traceable.
        mpi4py: ``(comm, send, recv) -> out``: the MPI call on NumPy buffers,
            returning the buffer that holds the result.
        sized: False for barrier, which moves no data.
        defined: ``(rank, size) -> bool``, whether MPI defines the result on
            that rank (the result check compares only those).
        min_size: the fewest ranks the op needs.
    """

    name: str
    split: bool
    out_shape: Callable[[tuple[int, ...], int], tuple[int, ...]]
    jaxcomm: Callable[[JaxComm, jax.Array], Any]
    mpi4py: Callable[[MPI.Intracomm, np.ndarray, np.ndarray], Any]
    sized: bool = True
    defined: Callable[[int, int], bool] = lambda rank, size: True
    min_size: int = 1


def _same(shape, size):
    return shape


def _stacked(shape, size):
    return (size, *shape)


def _unstacked(shape, size):
    return shape[1:]


def _on_root(rank, size):
    return rank == 0


def _after_first(rank, size):
    return rank > 0


def ring(rank: int, size: int) -> tuple[int, int]:
    """The ring exchange's peers: (source, dest) = (rank - 1, rank + 1)."""
    return (rank - 1) % size, (rank + 1) % size


def partner(rank: int, size: int) -> int | None:
    """The ping-pong partner (0-1, 2-3, ...), or None for the last of an odd count."""
    peer = rank ^ 1
    return peer if peer < size else None


def pingpong(rank, size, x, send, recv):
    """A ping-pong round trip: even ranks send ``x`` then receive, odd ranks echo.

    ``send(array, peer)`` and ``recv(template, peer) -> array`` are the
    library's calls; the result is what this rank received (``x`` on a rank
    without a partner).
    """
    peer = partner(rank, size)
    if peer is None:
        return x
    if rank % 2 == 0:
        send(x, peer)
        return recv(x, peer)
    y = recv(x, peer)
    send(y, peer)
    return y


def _pingpong_jaxcomm(jc, x):
    return pingpong(
        jc.rank,
        jc.size,
        x,
        lambda v, peer: jc.send(v, dest=peer),
        lambda v, peer: jc.recv(v, source=peer),
    )


def _pingpong_mpi4py(comm, s, r):
    def recv(_, peer):
        comm.Recv(r, source=peer)
        return r

    return pingpong(comm.rank, comm.size, s, lambda v, peer: comm.Send(v, dest=peer), recv)


def _sendrecv_jaxcomm(jc, x):
    source, dest = ring(jc.rank, jc.size)
    return jc.sendrecv(x, x, source=source, dest=dest)


def _sendrecv_mpi4py(comm, s, r):
    source, dest = ring(comm.rank, comm.size)
    comm.Sendrecv(s, dest, recvbuf=r, source=source)
    return r


def ragged_counts(rank: int, size: int, block: int) -> list[int]:
    """Rows the ragged exchange's ``rank`` sends each peer: ``block``, or half of it.

    Rank ``i`` sends rank ``j`` a whole block when ``i + j`` is even, half
    of one (rounded up) when it is odd: every rank's blocks differ in size,
    and what it receives differs from what it sends.
    """
    return [block if (rank + j) % 2 == 0 else (block + 1) // 2 for j in range(size)]


def _ragged_jaxcomm(jc, x):
    # A migration step: the counts are computed inside jit (traced), and
    # jaxcomm learns the receive counts (MPI_Alltoall) before the
    # MPI_Alltoallv, into a buffer of x's rows.
    block = x.shape[1]
    peer = jnp.arange(jc.size, dtype=jnp.int32)
    counts = jnp.where((jc.rank + peer) % 2 == 0, block, (block + 1) // 2).astype(jnp.int32)
    y, _ = jc.alltoallv(x.reshape(-1), counts)
    return y.reshape(x.shape)


def _ragged_mpi4py(comm, s, r):
    # The same step with mpi4py: MPI_Alltoall of the counts, then MPI_Alltoallv.
    size = comm.Get_size()
    sendcounts = np.array(ragged_counts(comm.Get_rank(), size, s.shape[1]), np.int32)
    recvcounts = np.empty(size, np.int32)
    comm.Alltoall(sendcounts, recvcounts)
    senddispls = np.cumsum(sendcounts, dtype=np.int32) - sendcounts
    recvdispls = np.cumsum(recvcounts, dtype=np.int32) - recvcounts
    comm.Alltoallv([s, sendcounts, senddispls, MPI.FLOAT], [r, recvcounts, recvdispls, MPI.FLOAT])
    return r


def _bcast_mpi4py(comm, s, r):
    comm.Bcast(s, root=0)  # MPI_Bcast works in place: root's buffer is the message
    return s


def _mpi4py_call(method, **kwargs):
    """An mpi4py buffer method as ``(comm, send, recv) -> recv``."""

    def call(comm, s, r):
        getattr(comm, method)(s, r, **kwargs)
        return r

    return call


OPS: dict[str, Op] = {
    op.name: op
    for op in (
        Op(
            "allreduce",
            False,
            _same,
            lambda jc, x: jc.allreduce(x),
            _mpi4py_call("Allreduce", op=MPI.SUM),
        ),
        Op(
            "reduce",
            False,
            _same,
            lambda jc, x: jc.reduce(x, root=0),
            _mpi4py_call("Reduce", op=MPI.SUM, root=0),
            defined=_on_root,
        ),
        Op("bcast", False, _same, lambda jc, x: jc.bcast(x, root=0), _bcast_mpi4py),
        Op("allgather", False, _stacked, lambda jc, x: jc.allgather(x), _mpi4py_call("Allgather")),
        Op(
            "gather",
            False,
            _stacked,
            lambda jc, x: jc.gather(x, root=0),
            _mpi4py_call("Gather", root=0),
            defined=_on_root,
        ),
        Op(
            "scatter",
            True,
            _unstacked,
            lambda jc, x: jc.scatter(x, root=0),
            _mpi4py_call("Scatter", root=0),
        ),
        Op("alltoall", True, _same, lambda jc, x: jc.alltoall(x), _mpi4py_call("Alltoall")),
        Op(
            "reduce_scatter",
            True,
            _unstacked,
            lambda jc, x: jc.reduce_scatter(x),
            _mpi4py_call("Reduce_scatter_block", op=MPI.SUM),
        ),
        Op("ragged", True, _same, _ragged_jaxcomm, _ragged_mpi4py),
        Op("scan", False, _same, lambda jc, x: jc.scan(x), _mpi4py_call("Scan", op=MPI.SUM)),
        Op(
            "exscan",
            False,
            _same,
            lambda jc, x: jc.exscan(x),
            _mpi4py_call("Exscan", op=MPI.SUM),
            defined=_after_first,
        ),
        Op("sendrecv", False, _same, _sendrecv_jaxcomm, _sendrecv_mpi4py),
        Op("send_recv", False, _same, _pingpong_jaxcomm, _pingpong_mpi4py, min_size=2),
        Op(
            "barrier",
            False,
            _same,
            lambda jc, x: jc.barrier(),
            lambda comm, s, r: comm.Barrier(),
            sized=False,
        ),
    )
}


def input_shape(op: Op, nbytes: int, size: int) -> tuple[int, ...]:
    """Each rank's float32 input for a message of about ``nbytes`` bytes."""
    if not op.sized:
        return (1,)
    count = max(1, nbytes // DTYPE.itemsize)
    return (size, max(1, count // size)) if op.split else (count,)


def check_data(shape: tuple[int, ...], rank: int) -> np.ndarray:
    """Small integers that differ per rank: every result is exact in float32."""
    count = int(np.prod(shape))
    return ((np.arange(count) * 3 + rank * 7) % 5).astype(DTYPE).reshape(shape)


def loop_step(y: jax.Array, c: jax.Array) -> jax.Array:
    """The loop body's elementwise step: the op's result times 0.5, shaped as the carry.

    An output with an extra leading axis (allgather, gather) gives its first
    block; a smaller one (scatter, reduce_scatter) is broadcast.
    """
    if y is None:  # barrier
        return c
    if y.ndim > c.ndim:
        y = y[0]
    return jnp.broadcast_to(y * 0.5, c.shape).astype(c.dtype)


def loop_step_numpy(out: np.ndarray | None, carry: np.ndarray) -> None:
    """:func:`loop_step` for mpi4py: into the preallocated carry, no allocation."""
    if out is None:
        return
    np.multiply(out[0] if out.ndim > carry.ndim else out, 0.5, out=carry)


def fori(fn: Callable[[jax.Array], Any]) -> Callable[[jax.Array, Any], jax.Array]:
    """``(c, n) -> c`` after ``n`` iterations of ``c = loop_step(fn(c), c)``."""

    def loop(c, n):
        return jax.lax.fori_loop(0, n, lambda i, carry: loop_step(fn(carry), carry), c)

    return loop
