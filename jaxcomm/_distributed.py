"""Joining the MPI ranks into one multi-process JAX job (``jax.distributed``)."""

from __future__ import annotations

import socket

import jax
from mpi4py import MPI

from ._arguments import intracomm


def initialize_jax_distributed(
    comm: MPI.Intracomm | None = None, *, cpu_collectives: str | None = "gloo"
) -> None:
    """Start ``jax.distributed`` with one JAX process per rank of ``comm``, under any launcher.

    Rank 0 of ``comm`` picks a free port on its host and hands its address
    to the others over MPI (an ``MPI_Bcast``), so the coordinator needs no
    fixed port, no environment variables and no launcher support:
    ``jax.process_index()`` becomes the rank in ``comm``. JAX's own
    ``jax.distributed.initialize(cluster_detection_method="mpi4py")`` does
    the same with a port derived from the host name; under Slurm's ``srun``,
    ``jax.distributed.initialize()`` finds everything itself
    (docs/shard-map.md). Call it before anything starts JAX's backends
    (before the first JAX array), on every rank of ``comm``.

    Args:
        comm: the processes of the JAX job (default ``MPI.COMM_WORLD``).
        cpu_collectives: the value of ``jax_cpu_collectives_implementation``
            that JAX's collectives between CPU devices of several processes
            need (``"gloo"``; ``"mpi"`` where jaxlib can load an MPI through
            MPItrampoline), or ``None`` to leave it alone.

    Raises:
        TypeError: if ``comm`` is not an ``Intracomm``.
        RuntimeError: on every rank, if ``jax.distributed`` failed to start on
            any rank (JAX's backends already running, say), naming the first
            rank's reason.

    Example:
        >>> jaxcomm.initialize_jax_distributed()   # under mpiexec -n 4
        >>> jax.process_count(), len(jax.devices())
        (4, 4)
    """
    comm = intracomm(comm)
    error = None
    try:
        if cpu_collectives is not None:
            jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
        same_host = len(set(comm.allgather(socket.gethostname()))) == 1
        address = None
        if comm.Get_rank() == 0:
            with socket.socket() as probe:
                probe.bind(("", 0))
                port = probe.getsockname()[1]
            address = f"{'127.0.0.1' if same_host else socket.gethostname()}:{port}"
        address = comm.bcast(address)
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=comm.Get_size(),
            process_id=comm.Get_rank(),
        )
    except Exception as err:  # noqa: BLE001 - raised on every rank below
        error = f"rank {comm.Get_rank()}: {type(err).__name__}: {err}"
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        raise RuntimeError(f"jax.distributed did not start: {errors[0]}")
