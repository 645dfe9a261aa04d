"""Nonblocking operations: a start primitive per op, and the waits that complete them.

A start (``isend_p``, ``irecv_p``, ``iallreduce_p``, ``ibcast_p``,
``iallgather_p``, ``ialltoall_p``) makes the ``MPI_I*`` call and returns a
request handle (two int32: a slot of the kernels' request table and its
serial) and, where MPI fills one, the receive buffer. A wait
(``wait_send_p``, ``wait_recv_p``, ``wait_exchange_p``) takes the handle and
every buffer the operation uses, calls ``MPI_Wait`` and returns the receive
buffer aliased in place. Both carry jaxcomm's ordered effect, so starts and
waits run in program order with every other jaxcomm call. Because the wait
takes the send buffer, XLA keeps it alive and unmodified until then; because
the result comes out of the wait, aliased to the buffer MPI fills, nothing
reads it earlier and no data moves. The wait checks that it was handed the
very buffers MPI was given.

A :class:`Request` must be waited exactly once, in the traced function that
started it. :func:`check_requests` enforces that on every jaxpr lowered; the
Python object catches what it can earlier (waiting twice, a request passed
through a jit boundary or a loop carry).
"""

import contextvars
import weakref
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from .. import _compat, _runtime
from ._base import comm_primitive, no_output, not_differentiable
from ._batching import _placed, behind_rows, flat, stacked


def _handle_aval():
    return jax.core.ShapedArray((2,), np.dtype(np.int32))


def _send_start(aval, **_):
    return [_handle_aval()]


def _receive_start(aval, **_):
    return [_handle_aval(), jax.core.ShapedArray(aval.shape, aval.dtype)]


def _gather_start(aval, *, size, tiled, **_):
    shape = (size * aval.shape[0], *aval.shape[1:]) if tiled else (size, *aval.shape)
    return [_handle_aval(), jax.core.ShapedArray(shape, aval.dtype)]


def _received(handle, *buffers, **_):
    y = buffers[-1]
    return [jax.core.ShapedArray(y.shape, y.dtype)]


_start = partial(comm_primitive, host_only=True)
isend_p = _start("isend", _send_start, "jaxcomm_isend", ("comm", "dest", "tag"))
irecv_p = _start("irecv", _receive_start, "jaxcomm_irecv", ("comm", "source", "tag"))
iallreduce_p = _start("iallreduce", _receive_start, "jaxcomm_iallreduce", ("comm", "op"))
ibcast_p = _start("ibcast", _receive_start, "jaxcomm_ibcast", ("comm", "root"))
iallgather_p = _start("iallgather", _gather_start, "jaxcomm_iallgather", ("comm",))
ialltoall_p = _start("ialltoall", _receive_start, "jaxcomm_ialltoall", ("comm",))

# Operands (handle, send) / (handle, receive) / (handle, send, receive); the
# result takes the receive buffer's place.
wait_send_p = _start("wait_send", no_output, "jaxcomm_wait_send", ("comm",))
wait_recv_p = _start("wait_recv", _received, "jaxcomm_wait_recv", ("comm",), aliases={1: 0})
wait_exchange_p = _start(
    "wait_exchange", _received, "jaxcomm_wait_exchange", ("comm",), aliases={2: 0}
)
# JaxComm.during: operands waited for, an int32 1 out (no MPI call).
fence_p = _start(
    "fence", lambda *avals, **_: [jax.core.ShapedArray((), np.dtype(np.int32))],
    "jaxcomm_fence", ("comm",),
)

STARTS = (isend_p, irecv_p, iallreduce_p, ibcast_p, iallgather_p, ialltoall_p)
WAITS = (wait_send_p, wait_recv_p, wait_exchange_p)
_WAIT_OF = {isend_p: wait_send_p, irecv_p: wait_recv_p}

# The method each start stands for, for messages.
_METHOD = {p: p.name for p in STARTS}


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
        "_op", "_wait", "_handle", "_send", "_recv", "_comm", "_waited", "_traced",
        "_finalizer", "__weakref__",
    )

    def __init__(self, op, wait, handle, send, recv, comm):
        self._op = op
        self._wait = wait
        self._handle = handle
        self._send = send
        self._recv = recv
        self._comm = comm
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
        return f"<jaxcomm Request {self._op} {state}>"


def _no_crossing(request):
    raise TypeError(
        f"a jaxcomm request ({request._op}) cannot be returned from or passed into a "
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
        slot, serial = np.asarray(request._handle).tolist()
        keys.add((slot, serial & 0xFFFFFFFF))
    return keys


_runtime.eager_request_keys = _eager_keys


def start(prim, x, **params):
    """Bind the start primitive ``prim`` on ``x``.

    Args:
        prim: one of ``STARTS``.
        x: the operand (the send buffer, or for ``irecv`` the template).
        **params: the primitive's params.

    Returns:
        The :class:`Request`.
    """
    tracing = _compat.tracing()
    if tracing and not isinstance(x, jax.core.Tracer):
        # A constant: XLA may give each use of a literal its own copy, but
        # the start and the wait must see the same buffer.
        x = jax.lax.optimization_barrier(x)
    outs = prim.bind(x, **params)
    handle, recv = outs[0], (outs[1] if len(outs) > 1 else None)
    send = None if prim is irecv_p else x
    request = Request(
        prim.name, _WAIT_OF.get(prim, wait_exchange_p), handle, send, recv, params["comm"]
    )
    request._traced = tracing
    if not tracing:
        _eager_requests.add(request)
        request._finalizer = weakref.finalize(request, _orphaned, (handle, send, recv))
    return request


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
            f"this {request._op} request was waited already: wait for each request once"
        )
    traced = request._traced
    if isinstance(request._handle, jax.core.Tracer) and not _compat.tracer_is_live(
        request._handle
    ):
        raise RuntimeError(
            f"this {request._op} request was started inside a traced function (jax.jit, "
            "a loop body, a cond branch) that has finished: wait for it there"
        )
    if not traced and _compat.tracing():
        raise RuntimeError(
            f"this {request._op} request was started eagerly and cannot be waited inside "
            "jax.jit or another transformation: wait for it eagerly, or start it "
            "inside the traced function"
        )
    request._waited = True
    if request._finalizer is not None:
        request._finalizer.detach()
        _eager_requests.discard(request)
    buffers = [b for b in (request._send, request._recv) if b is not None]
    outs = request._wait.bind(request._handle, *buffers, comm=request._comm)
    # The request no longer holds the buffers: MPI is done with them.
    request._send = request._recv = None
    if request._wait is wait_send_p:
        return None
    (y,) = outs
    return y


def during(requests, fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` after the starts of ``requests`` and before their waits.

    Returns:
        What ``fn`` returns.
    """
    for request in requests:
        if not isinstance(request, Request):
            raise TypeError(f"during takes jaxcomm Requests, got {type(request).__name__}")
        if request._waited:
            raise RuntimeError(f"this {request._op} request was waited already")
    if not _compat.tracing() or not requests:
        return fn(*args, **kwargs)
    # XLA orders work by data alone (optimization barriers do not survive
    # XLA:CPU's passes). A fence is ordered after the starts like every
    # jaxcomm call and returns a 1 XLA cannot know in advance: fn's inputs are
    # selected by it, so fn runs after the starts. A second fence takes fn's
    # outputs as operands, and the waits are ordered after it.
    comm = requests[0]._comm
    (one,) = fence_p.bind(comm=comm)
    ready = one == 1
    args, kwargs = jax.tree_util.tree_map(partial(_after, ready), (args, kwargs))
    out = fn(*args, **kwargs)
    arrays = [leaf for leaf in jax.tree_util.tree_leaves(out) if isinstance(leaf, jax.Array)]
    fence_p.bind(*arrays, comm=comm)
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


@partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def _donating_wait(prim, comm, handle, recv, *send):
    return prim.bind(handle, *send, recv, comm=comm)


def _wait_impl(prim, handle, *buffers, comm):
    if prim is wait_send_p:
        return _compat.apply_primitive(prim, handle, *buffers, comm=comm)
    *send, recv = buffers
    return _donating_wait(prim, comm, handle, recv, *send)


# Set while an eager start or wait runs: its computation holds the start or
# the wait alone, which the check below must let through.
_eager = contextvars.ContextVar("jaxcomm_eager_request", default=False)


def _eagerly(impl, *args, **params):
    token = _eager.set(True)
    try:
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
            handle = eqn.invars[0]
            if handle not in starts:
                raise RuntimeError(
                    "jaxcomm: a request is waited in another traced function than the "
                    "one that started it (a loop body, a cond branch or a nested jit "
                    f"waits a request started outside it, at {_where(eqn)}): start and "
                    "wait each request in the same function"
                )
            if handle in waited:
                raise RuntimeError(
                    f"jaxcomm: a {starts[handle].primitive.name} request is waited twice "
                    f"(at {_where(eqn)})"
                )
            waited.add(handle)
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
    for handle, eqn in starts.items():
        if handle not in waited:
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
# blocking op lays it out. The handle is never batched. Where the batch had
# to be moved into place, the start sends from a new array: the wait must
# keep that one alive, not the caller's, so the start leaves it here for the
# wait's rule to take.

_moved_sends = {}

_LAYOUT = {
    isend_p: flat,
    irecv_p: flat,
    iallreduce_p: flat,
    ibcast_p: flat,
    iallgather_p: stacked,
    ialltoall_p: behind_rows,
}


def _start_batched(prim, axis_data, args, dims, **params):
    (x,), (dim,) = args, dims
    if dim is None:
        outs = prim.bind(x, **params)
        return outs, [None] * len(outs)
    in_axis, out_axis = _LAYOUT[prim](**params)
    moved = _placed(x, dim, in_axis, axis_data.size)
    outs = prim.bind(moved, **params)
    if moved is not x and prim is not irecv_p:
        _moved_sends.setdefault(id(x), []).append((x, outs[0], moved))
    return outs, [None] + [out_axis] * (len(outs) - 1)


def _moved_send(handle, x):
    """The array the start of ``handle`` sent from, where it moved ``x``'s batch axis."""
    entries = _moved_sends.get(id(x), [])
    for entry in entries:
        if entry[0] is x and entry[1] is handle:
            entries.remove(entry)
            if not entries:
                del _moved_sends[id(x)]
            return entry[2]
    return x


def _wait_batched(prim, axis_data, args, dims, **params):
    handle, *buffers = args
    _, *buffer_dims = dims
    if prim is not wait_recv_p:
        buffers[0] = _moved_send(handle, buffers[0])
    outs = prim.bind(handle, *buffers, **params)
    if prim is wait_send_p:
        return outs, []
    return outs, [buffer_dims[-1]]


def _fence_batched(axis_data, args, dims, **params):
    outs = fence_p.bind(*args, **params)
    return outs, [None]


_compat.fancy_primitive_batchers[fence_p] = _fence_batched
for _prim in STARTS:
    _compat.fancy_primitive_batchers[_prim] = partial(_start_batched, _prim)
for _prim in WAITS:
    _compat.fancy_primitive_batchers[_prim] = partial(_wait_batched, _prim)


# Differentiation: refused ---------------------------------------------------------
#
# Rules run on every rank (_compat.py), so every rank refuses alike, while
# tracing, before any MPI call.

_BLOCKING = {
    "isend": "send",
    "irecv": "recv",
    "iallreduce": "allreduce",
    "ibcast": "bcast",
    "iallgather": "allgather",
    "ialltoall": "alltoall",
}


def _refused(name):
    what = _BLOCKING.get(name)
    form = f"the blocking jc.{what}" if what else "the blocking forms"
    return not_differentiable(
        f"the nonblocking {name if what else 'wait'}: nonblocking operations have no "
        f"derivative rules; differentiate {form} instead"
    )


def _refuse_jvp(name, primals, tangents, **params):
    raise _refused(name)


def _refuse_transpose(name, cts, *args, **params):
    raise _refused(name)


for _prim in (*STARTS, *WAITS):
    ad.primitive_jvps[_prim] = partial(_refuse_jvp, _prim.name)
    ad.primitive_transposes[_prim] = partial(_refuse_transpose, _prim.name)


def _fence_jvp(primals, tangents, **params):
    # The fence's output does not depend on its operands' values.
    out = fence_p.bind(*primals, **params)
    return out, [ad.Zero(jax.core.ShapedArray((), jax.dtypes.float0))]


ad.primitive_jvps[fence_p] = _fence_jvp
