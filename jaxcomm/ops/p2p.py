"""Point to point: send, recv, sendrecv."""

from ._base import comm_primitive, no_output, same_as_input
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
