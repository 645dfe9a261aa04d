"""Point to point: send, recv, sendrecv.

Every receive has a second output, its envelope: an integer array
``[source, tag, count]`` (``count`` in elements) read from the ``MPI_Status``.
It is an ordinary array, so it costs no static parameter, works under
``jit``, and addresses the derivative messages of wildcard receives.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad
from mpi4py import MPI

from .. import _compat
from ._base import comm_primitive, derivative_comm, no_output, not_differentiable
from ._batching import batch_whole, batched_alike, flat

# Which side of sendrecv_addressed takes peer and tag from its envelope
# operand (kernels/p2p.cc).
RECEIVE_FROM_ENVELOPE = 1
SEND_TO_ENVELOPE = 2


def envelope_dtype():
    """The envelope's dtype: int64, or int32 where JAX runs without 64-bit types."""
    return jax.dtypes.canonicalize_dtype(np.int64)


def _with_envelope(aval, *_, **__):
    return [
        jax.core.ShapedArray(aval.shape, aval.dtype),
        jax.core.ShapedArray((3,), envelope_dtype()),
    ]


send_p = comm_primitive("send", no_output, "jaxcomm_send", ("handle", "dest", "tag"))
# recv takes its template as an operand, although the kernel never reads it:
# then transformations see it (a vmapped template makes a batched receive).
recv_p = comm_primitive("recv", _with_envelope, "jaxcomm_recv", ("handle", "source", "tag"))
# Received arrays keep buffers of their own: MPI_Sendrecv_replace, the only
# in-place exchange, goes through a temporary copy, and recv's template is
# usually a value still live (a constant), which XLA would copy to alias.
sendrecv_p = comm_primitive(
    "sendrecv",
    _with_envelope,
    "jaxcomm_sendrecv",
    ("handle", "source", "dest", "sendtag", "recvtag"),
)
# sendrecv whose receiving side (RECEIVE_FROM_ENVELOPE) or sending side
# (SEND_TO_ENVELOPE) takes its peer and tag from the envelope of an earlier
# receive, given as the second operand; the params of that side are unused.
# Only derivative rules bind it.
sendrecv_addressed_p = comm_primitive(
    "sendrecv_addressed",
    _with_envelope,
    "jaxcomm_sendrecv_addressed",
    ("handle", "source", "dest", "sendtag", "recvtag", "addressed"),
)


# status= in compiled code (JaxComm.recv, JaxComm.sendrecv): the kernel
# writes the envelope into the MPI_Status inside an mpi4py MPI.Status, by
# address, when the compiled code runs. That may be long after the trace that
# saw the object, which may be gone by then, so every Status traced into a
# program stays alive for good here (a few dozen bytes each). The address is
# a static param: the same Status traced again lowers to the same program.
write_status_p = comm_primitive(
    "write_status", no_output, "jaxcomm_write_status", ("handle", "address", "itemsize")
)
_kept_statuses = {}


def write_status(envelope, status, *, itemsize, handle):
    """Bind ``write_status_p``: fill ``status`` (an ``MPI.Status``) from a receive's envelope."""
    address = MPI._addressof(status)
    _kept_statuses[address] = status
    write_status_p.bind(envelope, address=address, itemsize=itemsize, handle=handle)


def _write_status_jvp(primals, tangents, **params):
    # The envelope is an integer array: there is no tangent to write.
    write_status_p.bind(*primals, **params)
    return [], []


def send(x, *, dest, tag, handle):
    """Bind ``send_p``: ``MPI_Send`` of ``x``."""
    send_p.bind(x, dest=dest, tag=tag, handle=handle)


def recv(template, *, source, tag, handle):
    """Bind ``recv_p``: ``MPI_Recv`` into a new array shaped like ``template``.

    Returns:
        The received array and its envelope ``[source, tag, count]``.
    """
    y, envelope = recv_p.bind(template, source=source, tag=tag, handle=handle)
    return y, envelope


def sendrecv(x, *, source, dest, sendtag, recvtag, handle):
    """Bind ``sendrecv_p``: ``MPI_Sendrecv``; the result has ``x``'s shape and dtype.

    Returns:
        The received array and its envelope ``[source, tag, count]``.
    """
    y, envelope = sendrecv_p.bind(
        x, source=source, dest=dest, sendtag=sendtag, recvtag=recvtag, handle=handle
    )
    return y, envelope


# vmap -------------------------------------------------------------------------
#
# A batched receive is one MPI call with one envelope, so the envelope output
# is never batched (its count is that of the whole batch).


def _envelope_unbatched(prim):
    batch_whole(prim, flat)
    rule = _compat.fancy_primitive_batchers[prim]

    def batched(axis_data, args, dims, **params):
        outs, out_dims = rule(axis_data, args, dims, **params)
        return outs, [out_dims[0], None]

    _compat.fancy_primitive_batchers[prim] = batched


def _addressed_batched(axis_data, args, dims, **params):
    # The address comes from one receive's envelope, so it is one envelope:
    # where JAX broadcast it along the batch, every member is the same.
    (x, address), (x_dim, address_dim) = args, dims
    if address_dim is not None:
        address = jnp.take(address, 0, axis=address_dim)
    if x_dim is not None and x_dim != 0:
        x = jnp.moveaxis(x, x_dim, 0)
    outs = sendrecv_addressed_p.bind(x, address, **params)
    return outs, [None if x_dim is None else 0, None]


batch_whole(send_p, flat)
_envelope_unbatched(recv_p)
_envelope_unbatched(sendrecv_p)
_compat.fancy_primitive_batchers[sendrecv_addressed_p] = _addressed_batched


# Differentiation -------------------------------------------------------------
#
# Messages are linear: a tangent travels as a second message after its
# primal (on the derivative communicator, like every derivative message), and
# a cotangent travels back along the message's path, with the message's own
# tag, so the receiver may select messages by tag in any order.
# Both sides of a message run the same rules (send: primal then tangent;
# receive: primal then tangent), so the messages pair up.
#
# A receive that matched a wildcard (MPI.ANY_SOURCE or MPI.ANY_TAG) is
# followed by a tangent receive addressed to the envelope its primal actually
# came with, not by a second wildcard receive, which could match another
# sender's message. MPI keeps messages between two ranks with one tag in
# order, so that receive gets the tangent sent right after that primal. The
# addressed receive transposes to a send back to the same envelope, which is
# how reverse mode works for wildcard receives. The envelope is an output of
# the primal receive, so jax.linear_transpose of the primal op itself (which
# has no envelope) refuses wildcards.
#
# Integer arrays have float0 tangents; neither side sends one. The envelope's
# tangent is always a float0 zero.
#
# send has no output; linearization keeps its tangent only because jaxcomm's
# effect is one JAX keeps there (_compat.py), and its transpose then receives
# the cotangent the receiver's transposed recv sends back.


def wildcard(source, tag):
    """Whether a receive from ``source`` with ``tag`` takes MPI.ANY_SOURCE or MPI.ANY_TAG.

    A receive from MPI.PROC_NULL never is one: it matches no message.
    """
    return source != MPI.PROC_NULL and (source == MPI.ANY_SOURCE or tag == MPI.ANY_TAG)


def _tag_back(tag):
    # A receive from MPI.PROC_NULL may have matched any tag; nothing is sent.
    return 0 if tag == MPI.ANY_TAG else tag


def _tangent(t):
    """The instantiated tangent, or None where the primal is an integer (float0)."""
    t = ad.instantiate_zeros(t)
    return None if t.aval.dtype == jax.dtypes.float0 else t


def _zero_envelope():
    return ad.Zero(jax.core.ShapedArray((3,), jax.dtypes.float0))


def _send_jvp(primals, tangents, *, dest, tag, handle):
    send_p.bind(*primals, dest=dest, tag=tag, handle=handle)
    t = _tangent(tangents[0])
    if t is not None:
        send_p.bind(t, dest=dest, tag=tag, handle=derivative_comm(handle))
    return [], []


def _receive_jvp(prim, wildcard_of, primals, tangents, *, handle, **params):
    y, envelope = prim.bind(*primals, handle=handle, **params)
    t = _tangent(tangents[0])
    derivative = derivative_comm(handle)
    if t is None:
        ty = ad.Zero(y.aval.to_tangent_aval())
    elif prim is sendrecv_addressed_p:
        ty, _ = prim.bind(t, primals[1], handle=derivative, **params)
    elif wildcard_of(**params):
        ty, _ = sendrecv_addressed_p.bind(
            t,
            envelope,
            source=MPI.PROC_NULL,
            dest=params.get("dest", MPI.PROC_NULL),
            sendtag=params.get("sendtag", 0),
            recvtag=0,
            addressed=RECEIVE_FROM_ENVELOPE,
            handle=derivative,
        )
    else:
        ty, _ = prim.bind(t, handle=derivative, **params)
    return [y, envelope], [ty, _zero_envelope()]


def _recv_wildcard(*, source, tag, **_):
    return wildcard(source, tag)


def _sendrecv_wildcard(*, source, recvtag, **_):
    return wildcard(source, recvtag)


def _cotangent(ct):
    """``ct`` instantiated, batched alike on every rank under ``vmap`` (``_batching.py``)."""
    return batched_alike(ad.instantiate_zeros(ct))


def _send_transpose(cts, x, *, dest, tag, handle):
    template = batched_alike(_compat.transpose_zeros(x.aval))
    back, _ = recv(template, source=dest, tag=tag, handle=handle)
    return [back]


def _refuse_wildcard(op, tag_name):
    return not_differentiable(
        f"{op} from MPI.ANY_SOURCE or with MPI.ANY_TAG by transposing it directly "
        "(jax.linear_transpose): the cotangent must go back to the envelope the "
        "message came with, which only jax.vjp, jax.grad and jax.linearize keep. "
        f"Pass an explicit source and {tag_name}, or differentiate with jax.vjp"
    )


def _recv_transpose(cts, template, *, source, tag, handle):
    # The cotangent of what arrived goes back to its sender, with the tag it
    # came with; the sender's send transposes to the matching receive.
    if wildcard(source, tag):
        raise _refuse_wildcard("recv", "tag")
    send(_cotangent(cts[0]), dest=source, tag=_tag_back(tag), handle=handle)
    return [None]


def _sendrecv_transpose(cts, x, *, source, dest, sendtag, recvtag, handle):
    if wildcard(source, recvtag):
        raise _refuse_wildcard("sendrecv", "recvtag")
    back, _ = sendrecv(
        _cotangent(cts[0]),
        source=dest,
        dest=source,
        sendtag=_tag_back(recvtag),
        recvtag=sendtag,
        handle=handle,
    )
    return [back]


def _sendrecv_addressed_transpose(
    cts, x, address, *, source, dest, sendtag, recvtag, addressed, handle
):
    # The side that used the envelope swaps direction and keeps it; the
    # other side swaps its peer and tag, as sendrecv's transpose does.
    if addressed == RECEIVE_FROM_ENVELOPE:
        params = dict(source=dest, dest=MPI.PROC_NULL, sendtag=0, recvtag=sendtag)
        flipped = SEND_TO_ENVELOPE
    else:
        params = dict(source=MPI.PROC_NULL, dest=source, sendtag=recvtag, recvtag=0)
        flipped = RECEIVE_FROM_ENVELOPE
    back, _ = sendrecv_addressed_p.bind(
        _cotangent(cts[0]), address, addressed=flipped, handle=handle, **params
    )
    return [back, None]


ad.primitive_jvps[send_p] = _send_jvp
ad.primitive_jvps[write_status_p] = _write_status_jvp
ad.primitive_jvps[recv_p] = partial(_receive_jvp, recv_p, _recv_wildcard)
ad.primitive_jvps[sendrecv_p] = partial(_receive_jvp, sendrecv_p, _sendrecv_wildcard)
ad.primitive_jvps[sendrecv_addressed_p] = partial(_receive_jvp, sendrecv_addressed_p, None)
ad.primitive_transposes[send_p] = _send_transpose
ad.primitive_transposes[recv_p] = _recv_transpose
ad.primitive_transposes[sendrecv_p] = _sendrecv_transpose
ad.primitive_transposes[sendrecv_addressed_p] = _sendrecv_addressed_transpose
