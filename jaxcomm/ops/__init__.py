"""jaxcomm primitives, one module per op family.

These functions take plain integer parameters; ``jaxcomm.JaxComm`` validates
user arguments and calls them.
"""

# Registers the derivative rules that bind another family's collectives.
from . import _crossing  # noqa: F401
from .barrier import barrier, barrier_p
from .bcast import bcast, bcast_p
from .gather import (
    allgather,
    allgather_p,
    allgatherv,
    allgatherv_p,
    alltoall,
    alltoall_p,
    alltoallv,
    alltoallv_p,
    gather,
    gather_p,
    gatherv,
    gatherv_p,
    scatter,
    scatter_p,
    scatterv,
    scatterv_p,
)
from .neighbor import (
    neighbor_allgather,
    neighbor_allgather_p,
    neighbor_allgatherv,
    neighbor_allgatherv_p,
    neighbor_alltoall,
    neighbor_alltoall_p,
    neighbor_alltoallv,
    neighbor_alltoallv_p,
)
from .p2p import (
    recv,
    recv_p,
    send,
    send_p,
    sendrecv,
    sendrecv_p,
    write_status,
    write_status_p,
)
from .ragged import (
    alltoallv_counts,
    alltoallv_counts_p,
    ragged_all_to_all,
    ragged_all_to_all_p,
)
from .reduction import (
    allreduce,
    allreduce_p,
    exscan,
    exscan_p,
    reduce,
    reduce_p,
    reduce_scatter,
    reduce_scatter_p,
    scan,
    scan_p,
)

__all__ = [
    "allgather",
    "allgather_p",
    "allgatherv",
    "allgatherv_p",
    "allreduce",
    "allreduce_p",
    "alltoall",
    "alltoall_p",
    "alltoallv",
    "alltoallv_p",
    "alltoallv_counts",
    "alltoallv_counts_p",
    "barrier",
    "barrier_p",
    "bcast",
    "bcast_p",
    "exscan",
    "exscan_p",
    "gather",
    "gather_p",
    "gatherv",
    "gatherv_p",
    "neighbor_allgather",
    "neighbor_allgather_p",
    "neighbor_allgatherv",
    "neighbor_allgatherv_p",
    "neighbor_alltoall",
    "neighbor_alltoall_p",
    "neighbor_alltoallv",
    "neighbor_alltoallv_p",
    "ragged_all_to_all",
    "ragged_all_to_all_p",
    "recv",
    "recv_p",
    "reduce",
    "reduce_p",
    "reduce_scatter",
    "reduce_scatter_p",
    "scan",
    "scan_p",
    "scatter",
    "scatter_p",
    "scatterv",
    "scatterv_p",
    "send",
    "send_p",
    "sendrecv",
    "sendrecv_p",
    "write_status",
    "write_status_p",
]
