"""jaxcomm beside mpi4jax and JAX's own multi-process collectives, in one run.

Run:  mpiexec -n 2 python benchmarks/compare.py [options of python -m jaxcomm.bench]

Times every op that each library has, beside mpi4py on NumPy buffers, with
``jaxcomm.bench``'s measurement (result check against mpi4py, medians of
repeats, ratios), by default in the ``jit`` and ``loop`` modes:

- jaxcomm: the ``JaxComm`` methods;
- mpi4jax: its functions, when it is importable (never a dependency of
  jaxcomm; see docs/benchmarks.md for how to build it);
- jax: ``jax.distributed`` across the mpiexec ranks (one CPU device each,
  gloo collectives) with ``shard_map``: ``psum`` (allreduce), ``all_gather``,
  ``all_to_all``, ``psum_scatter`` (reduce_scatter) and ``ppermute``
  (sendrecv on a ring). ``--no-jax`` leaves it out.

Rank 0 prints a table; ``--json`` and ``--plot`` as for ``jaxcomm.bench``.
"""

import functools
import socket
import sys

import jax
import numpy as np
from mpi4py import MPI

from jaxcomm import JaxComm, bench

AXIS = "ranks"


def start_jax_distributed(comm):
    """Join the ranks into one JAX job with CPU collectives over gloo.

    Must run before JAX starts its backends. Returns None, or why it failed
    (on every rank, when it failed on any).
    """
    error = None
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        same_host = len(set(comm.allgather(socket.gethostname()))) == 1
        address = None
        if comm.rank == 0:
            with socket.socket() as probe:
                probe.bind(("", 0))
                port = probe.getsockname()[1]
            host = "127.0.0.1" if same_host else socket.gethostname()
            address = f"{host}:{port}"
        address = comm.bcast(address)
        jax.distributed.initialize(
            coordinator_address=address, num_processes=comm.size, process_id=comm.rank
        )
    except Exception as err:  # noqa: BLE001 - reported, and the column left out
        error = f"{type(err).__name__}: {err}"
    errors = [e for e in comm.allgather(error) if e]
    return errors[0] if errors else None


class Mpi4jaxImpl(bench.JaxImpl):
    """mpi4jax's functions (it has no exscan or reduce_scatter)."""

    name = "mpi4jax"

    def __init__(self, comm):
        import mpi4jax

        rank, size = comm.rank, comm.size
        source, dest = bench.ring(rank, size)

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
            "send_recv": lambda x: bench.pingpong(
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


class JaxCollectivesImpl(bench.Impl):
    """JAX's collectives under ``shard_map``, one device per process."""

    name = "jax"
    modes = ("jit", "loop")

    def __init__(self):
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        devices = sorted(jax.devices(), key=lambda d: d.process_index)
        self.mesh = Mesh(np.array(devices), (AXIS,))
        self.spec, self.replicated = PartitionSpec(AXIS), PartitionSpec()
        self.sharded = NamedSharding(self.mesh, self.spec)
        self.scalar = NamedSharding(self.mesh, self.replicated)
        size = len(devices)
        ring = [(r, bench.ring(r, size)[1]) for r in range(size)]
        self.functions = {
            "allreduce": lambda v: jax.lax.psum(v, AXIS),
            "allgather": lambda v: jax.lax.all_gather(v, AXIS),
            "alltoall": lambda v: jax.lax.all_to_all(v, AXIS, 0, 0),
            "reduce_scatter": lambda v: jax.lax.psum_scatter(v, AXIS, scatter_dimension=0),
            "sendrecv": lambda v: jax.lax.ppermute(v, AXIS, ring),
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
        loop = bench.fori(fn)
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


def main(argv=None):
    """Measure every library's ops; rank 0 prints the table."""
    p = bench.parser("jaxcomm beside mpi4jax and JAX's own collectives.")
    p.add_argument(
        "--no-jax", action="store_true", help="leave out JAX's collectives (jax.distributed)"
    )
    p.set_defaults(modes=["jit", "loop"])
    args = p.parse_args(argv)
    bench.settings(args)  # a bad option fails before anything is measured
    comm = MPI.COMM_WORLD
    notes = {}
    jax_error = "left out (--no-jax)" if args.no_jax else start_jax_distributed(comm)
    jc = JaxComm(comm)
    impls = [bench.Mpi4pyImpl(comm), bench.JaxcommImpl(jc)]
    try:
        impls.append(Mpi4jaxImpl(comm))
    except ImportError as err:
        notes["mpi4jax"] = f"not measured: {err}"
    if jax_error is None:
        impls.append(JaxCollectivesImpl())
    else:
        notes["jax"] = f"not measured: {jax_error}"
    if comm.rank == 0:
        for name, note in notes.items():
            print(f"# {name}: {note}")
    names = [impl.name for impl in impls]
    try:
        bench.run_and_report(
            comm,
            impls,
            args,
            ratios=[(name, bench.REFERENCE) for name in names[1:]]
            + [("jaxcomm", name) for name in names[2:]],
            bandwidth=(),
            title="benchmarks/compare.py",
            libraries=names,
            notes=notes,
        )
    finally:
        jc.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
