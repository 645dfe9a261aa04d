"""JAX's own route: ``jax.distributed`` across the mpiexec ranks, collectives under ``shard_map``."""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
from mpi4py import MPI

from jaxcomm import JaxComm
from jaxcomm._distributed import initialize_jax_distributed
from jaxcomm.bench.operations import fori, ring
from jaxcomm.bench.routes.base import Impl

AXIS = "ranks"


COLLECTIVES = ("gloo", "mpi")  # jax_cpu_collectives_implementation values the route takes


def route_name(collectives: str) -> str:
    """The column of JAX's route over ``collectives``: ``jax`` (gloo) or ``jax_mpi``."""
    return "jax" if collectives == "gloo" else f"jax_{collectives}"


def start_jax_distributed(comm, collectives="gloo"):
    """Join the ranks into one JAX job with CPU collectives over ``collectives``.

    Must run before JAX starts its backends. Returns None, or why it failed
    (on every rank, when it failed on any).
    """
    # jaxlib's MPI collectives go through MPItrampoline, which ends the
    # process (no exception) when it has no MPI wrapper library to load.
    unwrapped = collectives == "mpi" and not os.environ.get("MPITRAMPOLINE_LIB")
    if comm.allreduce(unwrapped, op=MPI.LOR):
        return (
            "jaxlib's MPI collectives load MPI through MPItrampoline: set MPITRAMPOLINE_LIB "
            "to an MPIwrapper library built for this MPI"
        )
    try:
        initialize_jax_distributed(comm, cpu_collectives=collectives)
    except RuntimeError as err:
        return str(err)
    return None


class JaxCollectivesImpl(Impl):
    """JAX's collectives under ``shard_map``, one device per process."""

    name = "jax"
    modes = ("jit", "loop")

    def __init__(self, collectives="gloo"):
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        self.name = route_name(collectives)

        devices = sorted(jax.devices(), key=lambda d: d.process_index)
        self.mesh = Mesh(np.array(devices), (AXIS,))
        self.spec, self.replicated = PartitionSpec(AXIS), PartitionSpec()
        self.sharded = NamedSharding(self.mesh, self.spec)
        self.scalar = NamedSharding(self.mesh, self.replicated)
        size = len(devices)
        perm = [(r, ring(r, size)[1]) for r in range(size)]
        self.functions = {
            "allreduce": lambda v: jax.lax.psum(v, AXIS),
            "allgather": lambda v: jax.lax.all_gather(v, AXIS),
            "alltoall": lambda v: jax.lax.all_to_all(v, AXIS, 0, 0),
            "reduce_scatter": lambda v: jax.lax.psum_scatter(v, AXIS, scatter_dimension=0),
            "sendrecv": lambda v: jax.lax.ppermute(v, AXIS, perm),
        }

    def supports(self, op, mode):
        return mode in self.modes and op.name in self.functions

    def _shard_map(self, body, in_specs):
        # check_vma off: a loop carry goes from varying to psum's invariant type.
        return jax.jit(
            jax.shard_map(
                body, mesh=self.mesh, in_specs=in_specs, out_specs=self.spec, check_vma=False
            )
        )

    @functools.cache  # noqa: B019 (one instance per benchmark run, kept to the end anyway)
    def _compiled(self, op, mode):
        fn = self.functions[op.name]
        if mode == "jit":
            return self._shard_map(lambda b: fn(b[0])[None], self.spec)
        loop = fori(fn)
        return self._shard_map(lambda b, n: loop(b[0], n)[None], (self.spec, self.replicated))

    def runner(self, op, mode, x):
        f = self._compiled(op, mode)
        local = jax.device_put(x[None], jax.local_devices()[0])
        size = self.mesh.devices.size
        g = jax.make_array_from_single_device_arrays((size, *x.shape), self.sharded, [local])
        if mode == "jit":

            def run(n):
                out = None
                for _ in range(n):
                    out = f(g)
                    out.block_until_ready()
                return out

            return run
        counts = {}

        def run(n):
            if n not in counts:
                counts[n] = jax.make_array_from_callback((), self.scalar, lambda _: np.int32(n))
            out = f(g, counts[n])
            out.block_until_ready()
            return out

        return run

    def to_numpy(self, out):
        return np.asarray(out.addressable_shards[0].data)[0]


class JaxcommShardMapImpl(JaxCollectivesImpl):
    """jaxcomm's collectives inside the same ``shard_map`` programs, on ``JaxComm.for_mesh``."""

    name = "jaxcomm_shard_map"

    def __init__(self):
        super().__init__()
        self.name = type(self).name
        self.jc = JaxComm.for_mesh(self.mesh, AXIS)
        source, dest = ring(self.jc.rank, self.jc.size)
        self.functions = {
            "allreduce": self.jc.allreduce,
            "allgather": self.jc.allgather,
            "alltoall": self.jc.alltoall,
            "reduce_scatter": self.jc.reduce_scatter,
            "sendrecv": lambda v: self.jc.sendrecv(v, v, source=source, dest=dest),
        }
