"""mpi4jax's route: its functions, when it is installed (it is never a dependency of jaxcomm)."""

from __future__ import annotations

import jax
from mpi4py import MPI

from jaxcomm.bench.operations import pingpong, ring
from jaxcomm.bench.routes.base import JaxImpl


class Mpi4jaxImpl(JaxImpl):
    """mpi4jax's functions (it has no exscan or reduce_scatter)."""

    name = "mpi4jax"

    def __init__(self, comm):
        import mpi4jax

        rank, size = comm.rank, comm.size
        source, dest = ring(rank, size)

        def barrier(x):
            mpi4jax.barrier(comm=comm)  # its result is not an array: give none

        self.functions = {
            "allreduce": lambda x: mpi4jax.allreduce(x, op=MPI.SUM, comm=comm),
            "reduce": lambda x: mpi4jax.reduce(x, MPI.SUM, 0, comm=comm),
            "bcast": lambda x: mpi4jax.bcast(x, 0, comm=comm),
            "allgather": lambda x: mpi4jax.allgather(x, comm=comm),
            "gather": lambda x: mpi4jax.gather(x, 0, comm=comm),
            # mpi4jax's non-root ranks pass the shape of their piece.
            "scatter": lambda x: mpi4jax.scatter(x if rank == 0 else x[0], 0, comm=comm),
            "alltoall": lambda x: mpi4jax.alltoall(x, comm=comm),
            "scan": lambda x: mpi4jax.scan(x, MPI.SUM, comm=comm),
            "sendrecv": lambda x: mpi4jax.sendrecv(x, x, source, dest, comm=comm),
            "send_recv": lambda x: pingpong(
                rank,
                size,
                x,
                lambda v, peer: mpi4jax.send(v, peer, comm=comm),
                lambda v, peer: mpi4jax.recv(v, peer, comm=comm),
            ),
            "barrier": barrier,
        }

    def supports(self, op, mode):
        return mode in self.modes and op.name in self.functions

    def function(self, op):
        return self.functions[op.name]

    def wait(self, out, op, mode):
        jax.block_until_ready(out)
        if not op.sized:
            jax.effects_barrier()
