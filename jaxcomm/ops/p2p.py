"""Point to point: send, recv, sendrecv."""

from functools import partial

import jax.numpy as jnp
from jax.interpreters import ad
from mpi4py import MPI

from ._base import comm_primitive, linear_jvp, no_output, not_differentiable, same_as_input
from ._batching import batch_whole, flat

send_p = comm_primitive("send", no_output, "jaxcomm_send", ("comm", "dest", "tag"))
# recv takes its template as an operand, although the kernel never reads it:
# then transformations see it (a vmapped template makes a batched receive).
recv_p = comm_primitive(
    "recv", same_as_input, "jaxcomm_recv", ("comm", "source", "tag", "status")
)
sendrecv_p = comm_primitive(
    "sendrecv",
    same_as_input,
    "jaxcomm_sendrecv",
    ("comm", "source", "dest", "sendtag", "recvtag", "status"),
)


def send(x, *, dest, tag, comm):
    """Bind ``send_p``: ``MPI_Send`` of ``x``."""
    send_p.bind(x, dest=dest, tag=tag, comm=comm)


def recv(template, *, source, tag, status, comm):
    """Bind ``recv_p``: ``MPI_Recv`` into a new array shaped like ``template``.

    ``status`` is the address of an ``MPI_Status`` to fill, or 0.
    """
    (y,) = recv_p.bind(template, source=source, tag=tag, status=status, comm=comm)
    return y


def sendrecv(x, *, source, dest, sendtag, recvtag, status, comm):
    """Bind ``sendrecv_p``: ``MPI_Sendrecv``; the result has ``x``'s shape and dtype."""
    (y,) = sendrecv_p.bind(
        x, source=source, dest=dest, sendtag=sendtag, recvtag=recvtag, status=status, comm=comm
    )
    return y


# vmap -------------------------------------------------------------------------

for _prim in (send_p, recv_p, sendrecv_p):
    batch_whole(_prim, flat)


# Differentiation -------------------------------------------------------------
#
# Messages are linear: a tangent travels as a second message along the same
# path, and sendrecv's cotangent travels back the other way. Backward passes
# run in reverse program order on every rank, so the reversed messages pair up
# in order; their receives match any tag for the same reason, and a send whose
# forward receive matched any tag uses tag 0. A receive that matched any
# source has no path back.
#
# send has no output; linearization keeps its tangent only because jaxcomm's
# effect is one JAX keeps there (_compat.py), and its transpose then receives
# the cotangent the receiver's transposed recv sends back.


def _tag_back(tag):
    return 0 if tag == MPI.ANY_TAG else tag


def _recv_transpose(cts, template, *, source, tag, status, comm):
    # The cotangent of what arrived goes back to its sender, whose send
    # transposes to the matching receive.
    if source == MPI.ANY_SOURCE:
        raise not_differentiable("recv from MPI.ANY_SOURCE in reverse mode")
    send(ad.instantiate_zeros(cts[0]), dest=source, tag=_tag_back(tag), comm=comm)
    return [None]


def _send_transpose(cts, x, *, dest, tag, comm):
    back = recv(
        jnp.zeros(x.aval.shape, x.aval.dtype),
        source=dest,
        tag=MPI.ANY_TAG,
        status=0,
        comm=comm,
    )
    return [back]


def _sendrecv_transpose(cts, x, *, source, dest, sendtag, recvtag, status, comm):
    if source == MPI.ANY_SOURCE:
        raise not_differentiable("sendrecv from MPI.ANY_SOURCE in reverse mode")
    ct = ad.instantiate_zeros(cts[0])
    back = sendrecv(
        ct,
        source=dest,
        dest=source,
        sendtag=_tag_back(recvtag),
        recvtag=MPI.ANY_TAG,
        status=0,
        comm=comm,
    )
    return [back]


for _prim in (send_p, recv_p, sendrecv_p):
    ad.primitive_jvps[_prim] = partial(linear_jvp, _prim)
ad.primitive_transposes[send_p] = _send_transpose
ad.primitive_transposes[recv_p] = _recv_transpose
ad.primitive_transposes[sendrecv_p] = _sendrecv_transpose
