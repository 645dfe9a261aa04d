"""Nonblocking operations: a start primitive per op, and the waits that complete them.

A start (``isend_p``, ``irecv_p``, ``iallreduce_p``, ``ireduce_p``,
``iscan_p``, ``ibcast_p``, ``iallgather_p``, ``igather_p``, ``iscatter_p``,
``ialltoall_p``, ``ialltoallv_p``, ``ineighbor_alltoall_p``,
``ineighbor_allgather_p``, ``iragged_all_to_all_p``, ``ialltoallv_counts_p``,
``ineighbor_alltoallv_p``, ``ineighbor_allgatherv_p``) makes the ``MPI_I*`` call and returns a request id (a slot of the kernels'
request table and its serial, as the bits of a float32[2]) and, where MPI
fills one, the receive buffer. A wait (``wait_send_p``, ``wait_recv_p``,
``wait_exchange_p``, ``wait_ragged_p``) takes the request id and every buffer
the operation uses, calls ``MPI_Wait`` and returns the receive buffer aliased
in place.

The exchanges whose counts are operands (``iragged_all_to_all_p``,
``ialltoallv_counts_p``: the nonblocking ``ragged_all_to_all`` and
``alltoallv`` with this rank's counts) take the operand, the output and the
index arrays, as their blocking forms (``ragged.py``). Their start makes the
blocking form's header exchange (an ``MPI_Alltoall``, short) and its checks,
then starts the rows' ``MPI_Ialltoallv``; it also returns what the headers
told it (the blocking form's second result). Their wait (``wait_ragged_p``)
takes the index arrays too, which only ride along for the derivative rules.
``ineighbor_alltoallv_p`` is the same with ``neighbor.py``'s header exchange
(an ``MPI_Neighbor_alltoall``) and ``MPI_Ineighbor_alltoallv``, and
``ineighbor_allgatherv_p`` with that header exchange and
``MPI_Ineighbor_allgatherv``.

Starts and waits carry jaxcomm's ordered effect, so they run in program
order with every other jaxcomm call. Because the wait
takes the send buffer, XLA keeps it alive and unmodified until then; because
the result comes out of the wait, aliased to the buffer MPI fills, nothing
reads it earlier and no data moves. The wait checks that it was handed the
very buffers the start was given.

Each operation is one row of ``OPERATIONS`` (an :class:`Operation`): its
start, its wait, its blocking counterpart, where ``vmap`` puts the batch and
how it is differentiated. Every rule below reads the row rather than asking
which operation it has.

A :class:`Request` must be waited exactly once, in the traced function that
started it. :func:`check_requests` enforces that on every jaxpr lowered; the
Python object catches what it can earlier (waiting twice, a request passed
through a jit boundary or a loop carry).
"""

import contextvars
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad

from .. import _compat, _runtime
from ._adjoint import replicated_adjoint
from ._base import (
    SUM,
    comm_primitive,
    derivative_comm,
    no_output,
    not_differentiable,
    op_name,
    per_device_values,
    replicated_starts,
    vary_like,
    vary_over_comm,
)
from ._batching import batched_alike, behind_rows, flat, placed, split, stacked
from ._crossing import contribution
from .bcast import bcast
from .gather import allgather, alltoall, alltoallv, gather, scatter
from .neighbor import (
    allgatherv_transpose,
    blocks_behind,
    gathered_counts,
    indegree,
    neighbor_allgather,
    neighbor_allgatherv,
    neighbor_alltoall,
    neighbor_alltoallv,
    neighbor_counts,
    output_written,
    reverse_comm,
    reverse_counts,
    sent_back,
    zero_from_nowhere,
)
from .p2p import recv, send, wildcard
from .ragged import alltoallv_counts, counts_indices, output_cotangent, ragged_all_to_all
from .reduction import allreduce, reduce, scan


def _request_id_aval():
    # A float type: a tangent or cotangent of a request_id is then another
    # request's request_id (see the derivative rules at the end).
    return jax.core.ShapedArray((2,), np.dtype(np.float32))


def _send_start(aval, **_):
    return [_request_id_aval()]


def _receive_start(aval, **_):
    return [_request_id_aval(), jax.core.ShapedArray(aval.shape, aval.dtype)]


def _gather_start(aval, *, size, tiled, **_):
    shape = (size * aval.shape[0], *aval.shape[1:]) if tiled else (size, *aval.shape)
    return [_request_id_aval(), jax.core.ShapedArray(shape, aval.dtype)]


def _scatter_start(aval, *, size, tiled, **_):
    shape = (aval.shape[0] // size, *aval.shape[1:]) if tiled else aval.shape[1:]
    return [_request_id_aval(), jax.core.ShapedArray(shape, aval.dtype)]


def _alltoallv_start(aval, *, recvcounts, **_):
    shape = (sum(recvcounts), *aval.shape[1:])
    return [_request_id_aval(), jax.core.ShapedArray(shape, aval.dtype)]


def _neighbor_start(aval, *, handle):
    return [
        _request_id_aval(),
        jax.core.ShapedArray((indegree(handle), *aval.shape[1:]), aval.dtype),
    ]


def _neighbor_gather_start(aval, *, handle):
    return [_request_id_aval(), jax.core.ShapedArray((indegree(handle), *aval.shape), aval.dtype)]


def _exchange_start(operand, output, indices, **_):
    return [
        _request_id_aval(),
        jax.core.ShapedArray(output.shape, output.dtype),
        jax.core.ShapedArray((2, indices.shape[1]), indices.dtype),
    ]


def _neighbor_exchange_start(x, output, counts, *, handle, **_):
    return [
        _request_id_aval(),
        jax.core.ShapedArray(output.shape, output.dtype),
        jax.core.ShapedArray((indegree(handle),), counts.dtype),
    ]


def _received(request_id, *buffers, **_):
    y = buffers[-1]
    return [jax.core.ShapedArray(y.shape, y.dtype)]


isend_p = comm_primitive("isend", _send_start, "jaxcomm_isend", ("handle", "dest", "tag"))
irecv_p = comm_primitive("irecv", _receive_start, "jaxcomm_irecv", ("handle", "source", "tag"))
iallreduce_p = comm_primitive("iallreduce", _receive_start, "jaxcomm_iallreduce", ("handle", "op"))
ireduce_p = comm_primitive("ireduce", _receive_start, "jaxcomm_ireduce", ("handle", "op", "root"))
iscan_p = comm_primitive("iscan", _receive_start, "jaxcomm_iscan", ("handle", "op"))
ibcast_p = comm_primitive("ibcast", _receive_start, "jaxcomm_ibcast", ("handle", "root"))
iallgather_p = comm_primitive("iallgather", _gather_start, "jaxcomm_iallgather", ("handle",))
igather_p = comm_primitive(
    "igather", _gather_start, "jaxcomm_igather", ("handle", "root"), root_only="output"
)
iscatter_p = comm_primitive(
    "iscatter", _scatter_start, "jaxcomm_iscatter", ("handle", "root"), root_only="input"
)
ialltoall_p = comm_primitive("ialltoall", _receive_start, "jaxcomm_ialltoall", ("handle",))
ialltoallv_p = comm_primitive(
    "ialltoallv",
    _alltoallv_start,
    "jaxcomm_ialltoallv",
    ("handle", "sendcounts", "recvcounts"),
)
ineighbor_alltoall_p = comm_primitive(
    "ineighbor_alltoall", _neighbor_start, "jaxcomm_ineighbor_alltoall", ("handle",)
)
ineighbor_allgather_p = comm_primitive(
    "ineighbor_allgather", _neighbor_gather_start, "jaxcomm_ineighbor_allgather", ("handle",)
)
iragged_all_to_all_p = comm_primitive(
    "iragged_all_to_all", _exchange_start, "jaxcomm_iragged_all_to_all", ("handle", "reverse")
)
ialltoallv_counts_p = comm_primitive(
    "ialltoallv_counts",
    _exchange_start,
    "jaxcomm_ialltoallv_counts",
    ("handle", "reverse", "check_sizes"),
)
ineighbor_alltoallv_p = comm_primitive(
    "ineighbor_alltoallv",
    _neighbor_exchange_start,
    "jaxcomm_ineighbor_alltoallv",
    ("handle", "reverse", "check_sizes"),
)
ineighbor_allgatherv_p = comm_primitive(
    "ineighbor_allgatherv",
    _neighbor_exchange_start,
    "jaxcomm_ineighbor_allgatherv",
    ("handle", "check_sizes"),
)

# Operands (request_id, send) / (request_id, receive) / (request_id, send, receive); the
# result takes the receive buffer's place.
wait_send_p = comm_primitive("wait_send", no_output, "jaxcomm_wait_send", ("handle",))
wait_recv_p = comm_primitive(
    "wait_recv", _received, "jaxcomm_wait_recv", ("handle",), aliases={1: 0}
)
wait_exchange_p = comm_primitive(
    "wait_exchange",
    _received,
    "jaxcomm_wait_exchange",
    ("handle",),
    aliases={2: 0},
    root_only="wait",
)
# Operands (request_id, send, index arrays, receive).
wait_ragged_p = comm_primitive(
    "wait_ragged", _received, "jaxcomm_wait_ragged", ("handle",), aliases={3: 0}
)
# JaxComm.during: operands waited for, an int32 1 out (no MPI call).
fence_p = comm_primitive(
    "fence",
    lambda *avals, **_: [jax.core.ShapedArray((), np.dtype(np.int32))],
    "jaxcomm_fence",
    ("handle",),
)


# The operations -----------------------------------------------------------------


@dataclass(frozen=True)
class Wait:
    """A wait primitive and the buffers it takes after the request_id.

    Attributes:
        prim: the primitive.
        sends: it takes the send buffer, which MPI reads until the wait.
        receives: it takes the receive buffer, last, and returns it filled.
        indexed: it takes the index arrays of an exchange whose counts are
            operands, after the send buffer.
    """

    prim: Primitive
    sends: bool
    receives: bool
    indexed: bool = False


WAIT_SEND = Wait(wait_send_p, sends=True, receives=False)
WAIT_RECV = Wait(wait_recv_p, sends=False, receives=True)
WAIT_EXCHANGE = Wait(wait_exchange_p, sends=True, receives=True)
WAIT_RAGGED = Wait(wait_ragged_p, sends=True, receives=True, indexed=True)


@dataclass(frozen=True)
class Reverse:
    """Reverse mode by a request in reverse: the cotangent goes back along the message's path.

    The wait's transpose starts the operation ``op``, and the start's
    transpose, later in the transposed program, waits it.

    Attributes:
        op: the name of the reverse operation.
        params: maps this operation's params (but ``handle``) to the reverse one's.
        comm: maps the handle of the communicator the operation ran on to the
            one the reverse runs on (a neighbourhood collective's: its
            reverse graph).
    """

    op: str
    params: Callable[[dict], dict]
    comm: Callable[[int], int] = lambda handle: handle


@dataclass(frozen=True)
class Replicated:
    """Reverse mode without a message, as the blocking replicated collective (``_adjoint.py``).

    The cotangent of the result is one replicated value; the start's
    transpose maps it to this rank's cotangent with ``replicated_adjoint`` of
    the blocking op's kind.

    Attributes:
        params: the params (of this operation) that the local map takes.
    """

    params: tuple[str, ...] = ()


@dataclass(frozen=True)
class Blocking:
    """Reverse mode as the blocking op's: no reverse request.

    The cotangent of the result goes to the start's transpose, which
    transposes the blocking op on it (for a scan, a total and an exclusive
    scan): that part of the backward pass does not overlap.
    """


@dataclass(frozen=True)
class Counted:
    """How the rules read an exchange whose counts are operands (``Operation.ragged``).

    Attributes:
        received: what its start learned -> the rows received from each peer
            (what the wait returns beside the result where they are learned).
        known: ``(index arrays, handle, **params)`` -> the index arrays of
            its reverse: everything the reverse needs to know (run by the
            wait's transpose).
        written: ``(ct, known index arrays, what the reverse learned, handle,
            **params)`` -> the output's cotangent: the result's ``ct`` with
            the rows the exchange wrote zeroed.
        sent_back: ``(what the reverse received, the index arrays, handle,
            **params)`` -> the operand's cotangent (run by the start's
            transpose, after the reverse's wait).
        transpose: for one transposed as its blocking form (:class:`Blocking`),
            ``(ct, operand, output, index arrays, handle, **params)`` -> the
            cotangents of the start's operands for ``ct`` of the result.
    """

    received: Callable = lambda learned: learned[1]
    known: Callable = lambda indices, handle, **params: indices
    written: Callable = lambda ct, indices, learned, handle, *, reverse, **_: output_cotangent(
        ct, indices, learned, reverse
    )
    sent_back: Callable = lambda packed, indices, handle, **params: packed
    transpose: Callable | None = None


# ragged_all_to_all and alltoallv by this rank's counts: the reversed exchange
# learns what it needs from the same index arrays.
RAGGED = Counted()
# neighbor_alltoallv: the reverse sends back what arrived, so where the
# exchange learned its recvcounts, its transpose learns them again (a
# neighbor_alltoall of the sendcounts), as the blocking form's does; nothing
# comes back from MPI.PROC_NULL.
NEIGHBOR_COUNTED = Counted(
    received=lambda learned: learned,
    known=reverse_counts,
    written=lambda ct, counts, learned, handle, **params: output_written(
        ct, counts, handle, **params
    ),
    sent_back=sent_back,
)
# neighbor_allgatherv: what comes back to a rank is a block per destination
# to be summed, which a reverse request could not hand over as the result's
# cotangent; it transposes as the blocking form (a neighbor_alltoallv on the
# reverse graph, then the sum).
NEIGHBOR_GATHERED = Counted(received=lambda learned: learned, transpose=allgatherv_transpose)


@dataclass(frozen=True)
class Operation:
    """One nonblocking operation, a row of ``OPERATIONS``.

    Attributes:
        start: its start primitive, whose operand is the send buffer (irecv:
            the template) and whose outputs are the request_id and, where the
            wait receives, the buffer MPI fills.
        wait: the wait that completes it.
        blocking: the blocking op it is the nonblocking form of.
        layout: where ``vmap`` puts the batch in its buffers (``_batching.py``),
            as the blocking op's batching rule puts it.
        transpose: how reverse mode takes a cotangent back
            (:class:`Reverse`, :class:`Replicated` or :class:`Blocking`).
        reduction: it reduces with its ``op`` param. A SUM is linear; with
            MAX, MIN or PROD the tangent needs the reduced value, so the
            start makes no tangent request and the wait's rule computes the
            tangent with the blocking op after the primal wait.
        sum_only: differentiable with MPI.SUM only, as the blocking op.
        from_wildcard: maps its params to whether it receives from
            MPI.ANY_SOURCE or with MPI.ANY_TAG, which it cannot
            differentiate (None: it names its sources).
        finish: ``(y, handle) -> y`` applied to what the wait returns
            (the neighbourhood collectives zero the blocks from
            ``MPI.PROC_NULL``, which MPI leaves unwritten).
        ragged: for an exchange whose counts are operands, how its rules
            read them (:class:`Counted`): its start takes (operand, output,
            index arrays) and also returns what it learned (``ragged.py``,
            ``neighbor.py``), and its wait is ``WAIT_RAGGED``.
    """

    start: Primitive
    wait: Wait
    blocking: Callable
    layout: Callable
    transpose: Reverse | Replicated | Blocking
    reduction: bool = False
    sum_only: bool = False
    from_wildcard: Callable[[dict], bool] | None = None
    finish: Callable[[jax.Array, int], jax.Array] | None = None
    ragged: Counted | None = None

    @property
    def name(self) -> str:
        """The method that starts it (``"isend"``, ``"iallreduce"``, ...)."""
        return self.start.name


def _same(params):
    return params


def _swapped(params):
    return dict(sendcounts=params["recvcounts"], recvcounts=params["sendcounts"])


def _reversed(params):
    return {**params, "reverse": 1 - params["reverse"]}


def _reversed_known(params):
    # The reverse's counts are all known (Counted.known).
    return {**params, "reverse": 1 - params["reverse"], "check_sizes": 1}


# By name (the start primitive's, and the JaxComm method's). Columns: start,
# wait, blocking, layout, transpose, then the choices that differ from the
# defaults.
OPERATIONS = {
    operation.name: operation
    for operation in (
        Operation(
            isend_p,
            WAIT_SEND,
            send,
            flat,
            Reverse("irecv", lambda p: dict(source=p["dest"], tag=p["tag"])),
        ),
        Operation(
            irecv_p,
            WAIT_RECV,
            recv,
            flat,
            Reverse("isend", lambda p: dict(dest=p["source"], tag=p["tag"])),
            from_wildcard=lambda p: wildcard(p["source"], p["tag"]),
        ),
        Operation(iallreduce_p, WAIT_EXCHANGE, allreduce, flat, Replicated(), reduction=True),
        Operation(ireduce_p, WAIT_EXCHANGE, reduce, flat, Blocking(), reduction=True),
        Operation(iscan_p, WAIT_EXCHANGE, scan, flat, Blocking(), sum_only=True),
        Operation(ibcast_p, WAIT_EXCHANGE, bcast, flat, Replicated(("root",))),
        Operation(iallgather_p, WAIT_EXCHANGE, allgather, stacked, Replicated(("size", "tiled"))),
        Operation(igather_p, WAIT_EXCHANGE, gather, stacked, Reverse("iscatter", _same)),
        Operation(iscatter_p, WAIT_EXCHANGE, scatter, split, Reverse("igather", _same)),
        Operation(ialltoall_p, WAIT_EXCHANGE, alltoall, behind_rows, Reverse("ialltoall", _same)),
        Operation(
            ialltoallv_p,
            WAIT_EXCHANGE,
            alltoallv,
            behind_rows,
            Reverse("ialltoallv", _swapped),
        ),
        Operation(
            ineighbor_alltoall_p,
            WAIT_EXCHANGE,
            neighbor_alltoall,
            behind_rows,
            Reverse("ineighbor_alltoall", _same, comm=reverse_comm),
            finish=zero_from_nowhere,
        ),
        Operation(
            ineighbor_allgather_p,
            WAIT_EXCHANGE,
            neighbor_allgather,
            blocks_behind,
            Blocking(),
            finish=zero_from_nowhere,
        ),
        Operation(
            iragged_all_to_all_p,
            WAIT_RAGGED,
            ragged_all_to_all,
            behind_rows,
            Reverse("iragged_all_to_all", _reversed),
            ragged=RAGGED,
        ),
        Operation(
            ialltoallv_counts_p,
            WAIT_RAGGED,
            alltoallv_counts,
            behind_rows,
            Reverse("ialltoallv_counts", _reversed),
            ragged=RAGGED,
        ),
        Operation(
            ineighbor_alltoallv_p,
            WAIT_RAGGED,
            neighbor_alltoallv,
            behind_rows,
            Reverse("ineighbor_alltoallv", _reversed_known, comm=reverse_comm),
            ragged=NEIGHBOR_COUNTED,
        ),
        Operation(
            ineighbor_allgatherv_p,
            WAIT_RAGGED,
            neighbor_allgatherv,
            behind_rows,
            Blocking(),
            ragged=NEIGHBOR_GATHERED,
        ),
    )
}

STARTS = tuple(operation.start for operation in OPERATIONS.values())
replicated_starts.update(
    name for name, operation in OPERATIONS.items() if isinstance(operation.transpose, Replicated)
)
_WAITS = {wait.prim: wait for wait in (WAIT_SEND, WAIT_RECV, WAIT_EXCHANGE, WAIT_RAGGED)}
WAITS = tuple(_WAITS)


# The request object ------------------------------------------------------------


class Request:
    """A nonblocking operation under way, returned by ``JaxComm.isend``, ``irecv``, ``i*``.

    Complete it with ``JaxComm.wait`` (or ``waitall``), exactly once, in the
    traced function that started it (or eagerly, for a request started
    eagerly). A request cannot be returned from a jitted function, passed
    into one or carried through a loop: jaxcomm raises a ``TypeError`` there.
    Until the wait, MPI owns the operation's buffers; jaxcomm keeps them alive.
    """

    __slots__ = (
        "_op",
        "_wait",
        "_start",
        "_id",
        "_send",
        "_recv",
        "_learned",
        "_handle",
        "_waited",
        "_traced",
        "_finalizer",
        "__weakref__",
    )

    def __init__(self, op, wait, start, request_id, sent, received, handle, learned=None):
        self._op = op
        self._wait = wait
        self._start = start
        self._id = request_id
        # The buffers the wait takes before the receive buffer: the send
        # buffer and, for an exchange whose counts are operands, the index arrays.
        self._send = sent
        self._recv = received
        # Returned by the wait beside the result, where the caller asked.
        self._learned = learned
        self._handle = handle
        self._waited = False
        self._traced = True
        self._finalizer = None

    @property
    def op(self) -> str:
        """The method that started the request (``"isend"``, ``"iallreduce"``, ...)."""
        return self._op

    @property
    def done(self) -> bool:
        """Whether the request was waited (``JaxComm.wait``)."""
        return self._waited

    def __repr__(self):
        state = "waited" if self._waited else "under way"
        return f"<jaxcomm Request {self.op} {state}>"


def _no_crossing(request):
    raise TypeError(
        f"a jaxcomm request ({request.op}) cannot be returned from or passed into a "
        "jitted function, carried through a loop (fori_loop, scan, while_loop) or a "
        "cond, or flattened as a pytree: wait for it with jc.wait(request) in the "
        "same function (loop body, branch) that started it"
    )


jax.tree_util.register_pytree_node(Request, _no_crossing, lambda aux, children: None)

# Requests started eagerly and not waited yet; jaxcomm.sync() does not
# report them while they are alive.
_eager_requests = weakref.WeakSet()

# Buffers of eager requests dropped unwaited: MPI may still use them, so they
# are never freed.
_orphans = []


def _orphaned(buffers):
    _orphans.append(buffers)


def _eager_keys():
    keys = set()
    for request in list(_eager_requests):
        slot, serial = np.asarray(request._id).view(np.int32).tolist()
        keys.add((slot, serial & 0xFFFFFFFF))
    return keys


_runtime.eager_request_keys = _eager_keys


def _describe(prim, params):
    """The wait's ``start`` param: the start primitive and its params but ``handle``."""
    return (prim.name, tuple(sorted((k, v) for k, v in params.items() if k != "handle")))


@_compat.eager_outside_mesh
def start(prim, x, *extras, learned=False, **params):
    """Bind the start primitive ``prim`` on ``x``.

    Args:
        prim: one of ``STARTS``.
        x: the operand (the send buffer, or for ``irecv`` the template).
        *extras: an exchange's output and index arrays (``Operation.ragged``).
        learned: the wait returns ``(y, rows)``, with the rows received from
            each peer that an exchange's start learned.
        **params: the primitive's params.

    Returns:
        The :class:`Request`.
    """
    operation = OPERATIONS[prim.name]
    if isinstance(operation.transpose, Replicated):
        x = vary_over_comm(x, params["handle"])
    tracing = _compat.tracing()
    if tracing and not isinstance(x, jax.core.Tracer):
        # A constant: XLA may give each use of a literal its own copy, but
        # the start and the wait must see the same buffer.
        x = jax.lax.optimization_barrier(x)
    elif operation.wait.sends and _compat.eager_tracer(x):
        # Under an eager jvp or vjp the start's and the wait's rules get the
        # primal and tangent values as given, where a NumPy array becomes a
        # device buffer of its own for each eager call (freed after it):
        # both must get one device array that lives until the wait.
        x = jax.lax.optimization_barrier(x)
    outs = prim.bind(x, *extras, **params)
    request_id = outs[0]
    sent = ((x,) if operation.wait.sends else ()) + (extras[-1:] if operation.wait.indexed else ())
    received = outs[1] if operation.wait.receives else None
    request = Request(
        prim.name,
        operation.wait,
        _describe(prim, params),
        request_id,
        sent,
        received,
        params["handle"],
        operation.ragged.received(outs[2]) if learned else None,
    )
    request._traced = tracing
    if not tracing:
        _eager_requests.add(request)
        request._finalizer = weakref.finalize(request, _orphaned, (request_id, sent, received))
    return request


def start_counts(x, output, sendcounts, recvcounts, *, handle, neighbors=False):
    """Start ``ialltoallv_counts_p``: rows of ``x`` in blocks of ``sendcounts``, packed into ``output``.

    ``recvcounts`` (or None: learned, and the wait returns them beside the
    rows) are checked against what arrives, as ``ragged.alltoallv_counts``.
    With ``neighbors``, start ``ineighbor_alltoallv_p`` instead: one block
    per destination, as ``neighbor.neighbor_alltoallv``.

    Returns:
        The :class:`Request`.
    """
    if neighbors:
        prim, (indices, check) = (
            ineighbor_alltoallv_p,
            neighbor_counts(sendcounts, recvcounts, handle),
        )
    else:
        prim, (indices, check) = ialltoallv_counts_p, counts_indices(sendcounts, recvcounts)
    return start(
        prim,
        x,
        output,
        indices,
        learned=not check,
        reverse=0,
        check_sizes=int(check),
        handle=handle,
    )


def start_gathered(x, output, sendcount, recvcounts, *, handle):
    """Start ``ineighbor_allgatherv_p``: x's first ``sendcount`` rows to every destination, packed into ``output``.

    ``recvcounts`` (or None: learned, and the wait returns them beside the
    rows) are checked against what arrives, as ``neighbor.neighbor_allgatherv``.

    Returns:
        The :class:`Request`.
    """
    counts, check = gathered_counts(sendcount, recvcounts, handle)
    return start(
        ineighbor_allgatherv_p,
        x,
        output,
        counts,
        learned=not check,
        check_sizes=int(check),
        handle=handle,
    )


def wait(request):
    """Bind the wait that completes ``request``.

    Returns:
        The received array, or None for a send.

    Raises:
        TypeError: ``request`` is not a :class:`Request`.
        RuntimeError: it was waited already, or is waited outside the traced
            function that started it.
    """
    if not isinstance(request, Request):
        raise TypeError(f"wait takes a jaxcomm Request, got {type(request).__name__}")
    if request._waited:
        raise RuntimeError(
            f"this {request.op} request was waited already: wait for each request once"
        )
    traced = request._traced
    if isinstance(request._id, jax.core.Tracer) and not _compat.tracer_is_live(request._id):
        raise RuntimeError(
            f"this {request.op} request was started inside a traced function (jax.jit, "
            "a loop body, a cond branch) that has finished: wait for it there"
        )
    if not traced and _compat.tracing():
        raise RuntimeError(
            f"this {request.op} request was started eagerly and cannot be waited inside "
            "jax.jit or another transformation: wait for it eagerly, or start it "
            "inside the traced function"
        )
    request._waited = True
    if request._finalizer is not None:
        request._finalizer.detach()
        _eager_requests.discard(request)
    buffers = [*request._send, *((request._recv,) if request._recv is not None else ())]
    wait = request._wait
    outs = wait.prim.bind(request._id, *buffers, handle=request._handle, start=request._start)
    # The request no longer holds the buffers: MPI is done with them.
    request._send, request._recv = (), None
    if not wait.receives:
        return None
    (y,) = outs
    finish = OPERATIONS[request.op].finish
    y = y if finish is None else finish(y, request._handle)
    return y if request._learned is None else (y, request._learned)


def during(requests, fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` after the starts of ``requests`` and before their waits.

    Returns:
        What ``fn`` returns.
    """
    for request in requests:
        if not isinstance(request, Request):
            raise TypeError(f"during takes jaxcomm Requests, got {type(request).__name__}")
        if request._waited:
            raise RuntimeError(f"this {request.op} request was waited already")
    if not _compat.tracing() or not requests:
        return fn(*args, **kwargs)
    # XLA orders work by data alone (optimization barriers do not survive
    # XLA:CPU's passes). A fence is ordered after the starts like every
    # jaxcomm call and returns a 1 XLA cannot know in advance: fn's inputs are
    # selected by it, so fn runs after the starts. A second fence takes fn's
    # outputs as operands, and the waits are ordered after it.
    handle = requests[0]._handle
    (one,) = fence_p.bind(handle=handle)
    ready = one == 1
    args, kwargs = jax.tree_util.tree_map(partial(_after, ready), (args, kwargs))
    out = fn(*args, **kwargs)
    arrays = [leaf for leaf in jax.tree_util.tree_leaves(out) if isinstance(leaf, jax.Array)]
    fence_p.bind(*arrays, handle=handle)
    return out


def _after(ready, leaf):
    if not isinstance(leaf, (jax.Array, np.ndarray)):
        return leaf
    return jax.lax.select(jnp.broadcast_to(ready, jnp.shape(leaf)), leaf, jnp.zeros_like(leaf))


# Eager waits donate the receive buffer ----------------------------------------
#
# A wait returns the receive buffer aliased in place. Inside a computation
# that buffer is the start's output, dead after the wait, so XLA aliases it
# without a copy. An eager wait gets it as an argument, which XLA would copy
# (reading it before MPI_Wait) unless it is donated: eager waits run through
# a jitted function that donates it.


@partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(4,))
def _donating_wait(prim, handle, start, request_id, received, *sent):
    return prim.bind(request_id, *sent, received, handle=handle, start=start)


def _wait_impl(prim, request_id, *buffers, handle, start):
    if not _WAITS[prim].receives:
        return _compat.apply_primitive(prim, request_id, *buffers, handle=handle, start=start)
    *sent, received = buffers
    return _donating_wait(prim, handle, start, request_id, received, *sent)


# Set while an eager start or wait runs: its computation holds the start or
# the wait alone, which the check below must let through.
_eager = contextvars.ContextVar("jaxcomm_eager_request", default=False)


def _eagerly(impl, *args, **params):
    token = _eager.set(True)
    try:
        with _compat.outside_mesh():
            return impl(*args, **params)
    finally:
        _eager.reset(token)


for _prim in STARTS:
    _prim.def_impl(partial(_eagerly, partial(_compat.apply_primitive, _prim)))
for _wait in WAITS:
    _wait.def_impl(partial(_eagerly, partial(_wait_impl, _wait)))


# The same traced function: checked on every jaxpr lowered ---------------------


def _check_requests(jaxpr):
    """Raise unless every request started in ``jaxpr`` is waited there, exactly once."""
    starts = {}
    waited = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive in WAITS:
            request_id = eqn.invars[0]
            if request_id not in starts:
                raise RuntimeError(
                    "jaxcomm: a request is waited in another traced function than the "
                    "one that started it (a loop body, a cond branch or a nested jit "
                    f"waits a request started outside it, at {_where(eqn)}): start and "
                    "wait each request in the same function"
                )
            if request_id in waited:
                raise RuntimeError(
                    f"jaxcomm: a {starts[request_id].primitive.name} request is waited twice "
                    f"(at {_where(eqn)})"
                )
            waited.add(request_id)
            for var in eqn.invars[1:]:
                _not_a_handle(starts, var, eqn)
            continue
        for var in eqn.invars:
            _not_a_handle(starts, var, eqn)
        if eqn.primitive in STARTS:
            starts[eqn.outvars[0]] = eqn
    for var in jaxpr.outvars:
        if var in starts:
            raise RuntimeError(
                f"jaxcomm: a {starts[var].primitive.name} request started at "
                f"{_where(starts[var])} leaves the traced function that started it: "
                "wait for it there"
            )
    for request_id, eqn in starts.items():
        if request_id not in waited:
            raise RuntimeError(
                f"jaxcomm: a {eqn.primitive.name} request started at {_where(eqn)} is "
                "never waited: every request needs a jc.wait in the traced function "
                "(loop body, branch) that started it"
            )


def _not_a_handle(starts, var, eqn):
    if _compat.is_var(var) and var in starts:
        raise RuntimeError(
            f"jaxcomm: a {starts[var].primitive.name} request started at "
            f"{_where(starts[var])} is passed to {eqn.primitive.name} (a loop, a cond, "
            "a nested jit or another op): wait for it with jc.wait in the traced "
            "function that started it"
        )


def _where(eqn):
    return _compat.eqn_site(eqn)


def _check_lowered(jaxpr):
    if _eager.get():
        return
    if any(e.primitive in STARTS or e.primitive in WAITS for e in jaxpr.eqns):
        _check_requests(jaxpr)


_compat.jaxpr_checks.append(_check_lowered)


# vmap -------------------------------------------------------------------------
#
# A batched start moves the whole batch in one MPI call, laid out as the
# blocking op lays it out. The request_id is never batched. Where the batch had
# to be moved into place, the start sends from a new array: the wait must
# keep that one alive, not the caller's, so the start leaves it here for the
# wait's rule to take.
#
# Under an eager vmap the batch is the caller's value itself, a NumPy array
# when vmap was given one. Each eager bind would copy it to the device anew,
# so the wait would check another buffer than the one MPI reads (or, where
# JAX shares the NumPy memory, MPI would read memory the caller may still
# write): the start sends from one copy of it, as held() makes for an
# unbatched call, which the wait then takes.

_moved_sends = {}


def _sent_from(x):
    """``x`` as an array that stays the same buffer from the start to the wait."""
    return x if isinstance(x, jax.Array) else jnp.array(x, copy=True)


def _start_batched(operation, axis_data, args, dims, **params):
    (x, *extras), (dim, *extra_dims) = args, dims
    prim = operation.start
    in_axis, out_axis = operation.layout(**params)
    if operation.ragged:
        if extra_dims[1] is not None:
            # One request moves one exchange: members with index arrays of
            # their own would need one each.
            raise NotImplementedError(
                f"jaxcomm: vmap of {operation.name} over index arrays that differ between "
                "batch members; batch only the operand and output, or use the blocking "
                f"{operation.blocking.__name__}"
            )
        # The operand or the output is batched: every row of both holds the
        # whole batch, as in the blocking form.
        extras[0] = placed(extras[0], extra_dims[0], in_axis, axis_data.size)
        moved = placed(x, dim, in_axis, axis_data.size)
    elif dim is None:
        moved, out_axis = x, None
    else:
        moved = placed(x, dim, in_axis, axis_data.size)
    if operation.wait.sends:
        moved = _sent_from(moved)
    outs = prim.bind(moved, *extras, **params)
    if moved is not x and operation.wait.sends:
        _moved_sends.setdefault(id(x), []).append((x, outs[0], moved))
    out_dims = [None] + [out_axis] * (len(outs) - 1)
    if operation.ragged:
        out_dims[2] = None  # what it learned, the same for the whole batch
    return outs, out_dims


def _moved_send(request_id, x):
    """The array the start of ``request_id`` sent from, where it moved ``x``'s batch axis."""
    entries = _moved_sends.get(id(x), [])
    for entry in entries:
        if entry[0] is x and entry[1] is request_id:
            entries.remove(entry)
            if not entries:
                del _moved_sends[id(x)]
            return entry[2]
    return x


def _wait_batched(wait, axis_data, args, dims, **params):
    request_id, *buffers = args
    _, *buffer_dims = dims
    if wait.sends:
        buffers[0] = _moved_send(request_id, buffers[0])
    outs = wait.prim.bind(request_id, *buffers, **params)
    return outs, ([buffer_dims[-1]] if wait.receives else [])


def _fence_batched(axis_data, args, dims, **params):
    outs = fence_p.bind(*args, **params)
    return outs, [None]


_compat.fancy_primitive_batchers[fence_p] = _fence_batched
for _operation in OPERATIONS.values():
    _compat.fancy_primitive_batchers[_operation.start] = partial(_start_batched, _operation)
for _wait in _WAITS.values():
    _compat.fancy_primitive_batchers[_wait.prim] = partial(_wait_batched, _wait)


# Derivatives --------------------------------------------------------------------
#
# A start's tangent is the same start on the tangent, on the derivative
# communicator, and its request_id is the request_id's tangent: the wait's rule finds
# the tangent request beside the primal one and waits both. Transposing that
# tangent program reverses each request (Reverse): the wait's transpose starts the
# reverse operation (the cotangent goes back along the message's path), and
# the start's transpose, which comes later in the transposed program, waits
# it. The reverse request_id is the tangent request_id's cotangent, so JAX hands it
# from one rule to the other. The buffers that go with a request_id, which MPI
# uses until the wait, ride beside it in _companions.
#
# Replicated collectives (iallreduce with SUM, ibcast, iallgather) transpose
# locally, like their blocking forms (Replicated, _adjoint.py): their cotangent
# needs no message. ireduce and iscan transpose as reduce and scan do
# (Blocking); igather and iscatter transpose into each other (Reverse). A
# reduction with MAX, MIN or PROD needs the reduced value for its tangent, so
# its wait's rule computes the tangent with the blocking collectives, after
# the primal wait. The exchanges whose counts are operands (ragged) reverse
# as their blocking forms do, started by the wait's transpose, which also
# gives the output's cotangent to the receive buffer; their index arrays ride
# with the wait, so that its transpose has them. ineighbor_allgatherv, whose
# reverse ends in a sum, transposes as its blocking form (Blocking, through
# Counted.transpose). Rules run on every rank (_compat.py).

# id(request_id) -> (request_id, buffers that go with it).
_companions = {}


def _keep(request_id, *buffers):
    _companions[id(request_id)] = (request_id, buffers)


def _take(request_id):
    entry = _companions.pop(id(request_id), None)
    if entry is None or entry[0] is not request_id:
        raise RuntimeError(
            "jaxcomm: internal error: a nonblocking request's derivative lost its buffers"
        )
    return entry[1]


def _inexact(aval):
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _zeros(outs):
    return [ad.Zero(jax.typeof(out).to_tangent_aval()) for out in outs]


def _sendable(ct, aval):
    """The cotangent ``ct`` of ``aval``, as an array MPI can send from until its wait."""
    if type(ct) is ad.Zero:
        # A constant: keep XLA from giving the start and the wait each a copy.
        ct = jax.lax.optimization_barrier(jnp.zeros(aval.shape, aval.dtype))
    # An eager vjp hands over the cotangent as given, maybe a NumPy array.
    return _sent_from(batched_alike(ct))


def _tangent_by_wait(operation, params):
    """Whether the wait's rule, not a tangent request, makes the tangent."""
    return operation.reduction and params["op"] != SUM


def _has_tangent(operation, x, params):
    """Whether the start of ``operation`` on ``x`` starts a tangent request too."""
    if not _inexact(jax.typeof(x)):
        return False
    if operation.sum_only and params["op"] != SUM:
        raise not_differentiable(f"{operation.name} with MPI.{op_name(params['op'])}")
    if operation.from_wildcard is not None and operation.from_wildcard(params):
        # The tangent's receive could match another sender's tangent.
        raise not_differentiable(
            f"{operation.name} from MPI.ANY_SOURCE or with MPI.ANY_TAG: the tangent must "
            "come from the rank and tag the message came with. Pass an explicit source "
            f"and tag, or differentiate the blocking jc.{operation.blocking.__name__}"
        )
    return not _tangent_by_wait(operation, params)


def _tangent_start(operation, ts, extras, handle, params, zeros=(None, None)):
    def tangent(i):
        # ``zeros``: the primal sweep's zeros for the buffers whose tangent
        # is a symbolic zero (see _start_linearize).
        return ad.instantiate_zeros(ts[i]) if zeros[i] is None else zeros[i]

    t = tangent(0)
    if operation.ragged:
        # The same exchange of the operand's and the output's tangents.
        output, indices = tangent(1), extras[1]
        touts = operation.start.bind(t, output, indices, handle=derivative_comm(handle), **params)
        _keep(touts[0], t, indices)
        return [*touts[:2], ad.Zero(jax.typeof(touts[2]).to_tangent_aval())]
    touts = operation.start.bind(t, handle=derivative_comm(handle), **params)
    # The tangent wait must get the very buffer the tangent start sent from.
    _keep(touts[0], *((t,) if operation.wait.sends else ()))
    return touts


def _start_linearize(operation, nonzeros, x, *extras, handle, **params):
    # Checked first: a refusal must come before any MPI call.
    tangent = _has_tangent(operation, x, params)
    outs = operation.start.bind(x, *extras, handle=handle, **params)
    if not tangent:
        return outs, [False] * len(outs), [], lambda residuals, *ts: _zeros(outs)
    # What an exchange learned is integers.
    out_nonzeros = [True, True, False] if operation.ragged else [True] * len(outs)
    # On jax 0.6, the zeros standing for a symbolic-zero tangent (the output
    # template's, mostly) are made here, in the primal sweep, and handed to
    # the tangent sweep as residuals: made there, they would be equations of
    # constants in the linear program, which 0.6's backward pass (under its
    # JAX_USE_DIRECT_LINEARIZE) transposes like the linear ones, and fails
    # on. Newer backward passes evaluate such equations first.
    residuals = [None, None]
    if nonzeros is not None and _compat.JAX_VERSION < (0, 7):
        buffers = (x, extras[0]) if operation.ragged else (x,)
        for i, (nonzero, b) in enumerate(zip(nonzeros, buffers)):
            residuals[i] = None if nonzero else jnp.zeros_like(b)
    return (
        outs,
        out_nonzeros,
        [r for r in residuals if r is not None],
        lambda kept, *ts: _tangent_start(
            operation, ts, extras, handle, params, _refill(residuals, kept)
        ),
    )


def _refill(pattern, kept):
    """``pattern`` with its non-None entries replaced, in order, by ``kept``."""
    kept = iter(kept)
    return [None if r is None else next(kept) for r in pattern]


def _wait_plan(buffers, handle, start):
    """How a wait's tangent is made: None (integers), "wait" or ("reduce", factor)."""
    name, params = start[0], dict(start[1])
    if not _inexact(jax.typeof(buffers[0])):
        return None
    if _tangent_by_wait(OPERATIONS[name], params):
        # The tangent is the SUM of factor * t over ranks (_crossing.py).
        x = buffers[0]
        factor = contribution(x, jnp.ones_like(x), params["op"], derivative_comm(handle), name)
        return ("reduce", factor)
    return "wait"


def _wait_tangent(wait, plan, tangents, handle, start):
    t_handle, *t_buffers = tangents
    derivative = derivative_comm(handle)
    if plan != "wait":
        t = ad.instantiate_zeros(t_buffers[0])
        name, params = start[0], dict(start[1])
        blocking = OPERATIONS[name].blocking
        return [blocking(plan[1] * t, **{**params, "op": SUM}, handle=derivative)]
    sent = _take(t_handle)
    received = t_buffers[-1:] if wait.receives else []
    return wait.prim.bind(t_handle, *sent, *received, handle=derivative, start=start)


def _wait_linearize(wait, nonzeros, request_id, *buffers, handle, start):
    outs = wait.prim.bind(request_id, *buffers, handle=handle, start=start)
    plan = _wait_plan(buffers, handle, start)
    if plan is None:
        return outs, [False] * len(outs), [], lambda residuals, *ts: _zeros(outs)
    residuals = [] if plan == "wait" else [plan[1]]

    def linearized(residuals, *tangents):
        again = plan if plan == "wait" else ("reduce", residuals[0])
        return _wait_tangent(wait, again, tangents, handle, start)

    return outs, [True] * len(outs), residuals, linearized


def _start_transpose(operation, cts, x, *extras, handle, **params):
    transpose = operation.transpose
    if isinstance(transpose, Replicated) and not per_device_values():
        # The wait's rule handed the cotangent of the result over as the
        # receive buffer's.
        ct = ad.instantiate_zeros(cts[1])
        local = {name: params[name] for name in transpose.params}
        kind = operation.blocking.__name__
        return [replicated_adjoint(ct, kind=kind, handle=handle, **local)]
    if isinstance(transpose, (Blocking, Replicated)):
        # A replicated one among per-device values transposes exactly, as
        # its blocking form does there (replicated_operand).
        ct = ad.instantiate_zeros(cts[1])
        if operation.ragged:
            return operation.ragged.transpose(ct, x, *extras, handle=handle, **params)
        blocking = partial(operation.blocking, handle=handle, **params)
        aval = jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype)
        return list(jax.linear_transpose(blocking, aval)(ct))
    # Wait for the reverse request the wait's transpose started.
    reverse = OPERATIONS[transpose.op]
    described = _describe(reverse.start, transpose.params(params))
    forward, handle = handle, transpose.comm(handle)
    outs = reverse.wait.prim.bind(cts[0], *_take(cts[0]), handle=handle, start=described)
    if not reverse.wait.receives:
        return [None]
    if operation.ragged:
        # The output's cotangent came from the wait's transpose, as the
        # receive buffer's.
        output, indices = extras
        x_ct = operation.ragged.sent_back(outs[0], indices, forward, **params)
        return [
            x_ct if ad.is_undefined_primal(x) else None,
            cts[1] if ad.is_undefined_primal(output) else None,
            None,
        ]
    return [outs[0] if reverse.finish is None else reverse.finish(outs[0], handle)]


def _wait_transpose(wait, cts, request_id, *buffers, handle, start):
    operation, params = OPERATIONS[start[0]], dict(start[1])
    transpose = operation.transpose
    if not isinstance(transpose, Reverse):
        # To the start's receive buffer, which varies where a replicated result does not.
        return [None] * len(buffers) + [vary_like(cts[0], buffers[-1].aval)]
    reverse = OPERATIONS[transpose.op]
    if operation.ragged:
        return _exchange_wait_transpose(operation, transpose, cts, buffers, handle, params)
    if reverse.wait.sends:
        # The cotangent of what arrived goes back.
        operand = _sendable(cts[0], buffers[-1].aval)
    else:
        # The cotangent of what was sent comes back into a template.
        operand = batched_alike(_compat.transpose_zeros(buffers[0].aval))
    outs = reverse.start.bind(operand, handle=transpose.comm(handle), **transpose.params(params))
    sent = (operand,) if reverse.wait.sends else ()
    received = (outs[1],) if reverse.wait.receives else ()
    _keep(outs[0], *sent, *received)
    return [outs[0]] + [None] * len(buffers)


def _aval(x):
    return x.aval if ad.is_undefined_primal(x) else jax.typeof(x)


def _exchange_wait_transpose(operation, transpose, cts, buffers, handle, params):
    """The wait's transpose of an exchange whose counts are operands.

    Starts the reversed exchange of the result's cotangent back to where the
    rows were read, and gives the output's cotangent (the result's, with
    the rows the exchange wrote zeroed) to the receive buffer, whose
    cotangent the start's transpose takes.
    """
    reverse = OPERATIONS[transpose.op]
    operand, indices, received = buffers
    indices = operation.ragged.known(indices, handle, **params)
    ct = _sendable(cts[0], _aval(received))
    zeros = batched_alike(_compat.transpose_zeros(_aval(operand)))
    outs = reverse.start.bind(
        ct, zeros, indices, handle=transpose.comm(handle), **transpose.params(params)
    )
    _keep(outs[0], ct, indices, outs[1])
    output_ct = operation.ragged.written(ct, indices, outs[2], handle, **params)
    return [outs[0], None, None, output_ct]


def _jvp_of(linearize, primals, tangents, **params):
    # The JVP is the linearization applied to the tangents at once.
    outs, _, residuals, linear = linearize(None, *primals, **params)
    return outs, linear(residuals, *tangents)


# The linearize rules bind the tangent starts and waits on the tangents
# themselves (JAX's fallback would trace the JVP rule apart from them), so
# that _companions is keyed by the handles the waits get.
for _prim, _linearize in (
    *((o.start, partial(_start_linearize, o)) for o in OPERATIONS.values()),
    *((w.prim, partial(_wait_linearize, w)) for w in _WAITS.values()),
):
    ad.primitive_jvps[_prim] = partial(_jvp_of, _linearize)
    _compat.def_linearization(_prim, _linearize)
for _operation in OPERATIONS.values():
    ad.primitive_transposes[_operation.start] = partial(_start_transpose, _operation)
for _wait in _WAITS.values():
    ad.primitive_transposes[_wait.prim] = partial(_wait_transpose, _wait)


def _fence_jvp(primals, tangents, **params):
    # The fence's output does not depend on its operands' values.
    out = fence_p.bind(*primals, **params)
    return out, [ad.Zero(jax.core.ShapedArray((), jax.dtypes.float0))]


ad.primitive_jvps[fence_p] = _fence_jvp
