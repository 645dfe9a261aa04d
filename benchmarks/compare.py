"""jaxcomm beside mpi4jax and JAX's own multi-process collectives, in one run.

Run:  mpiexec -n 2 python -m benchmarks.compare [options of python -m jaxcomm.bench]
      [--jax {gloo,mpi} | --no-jax] [--plot FILE.png]

Times every op that each library has, beside mpi4py on NumPy buffers, with
``jaxcomm.bench``'s measurement (result check against mpi4py, medians of
repeats, ratios), by default in the ``jit`` and ``loop`` modes:

- jaxcomm: the ``JaxComm`` methods;
- mpi4jax: its functions, when it is importable (never a dependency of
  jaxcomm; see docs/benchmarks.md for how to build it);
- jax: ``jax.distributed`` across the mpiexec ranks (one CPU device each,
  gloo collectives) with ``shard_map``: ``psum`` (allreduce), ``all_gather``,
  ``all_to_all``, ``psum_scatter`` (reduce_scatter) and ``ppermute``
  (sendrecv on a ring). ``--no-jax`` leaves it out; ``--jax mpi`` takes
  jaxlib's MPI collectives instead of gloo;
- c: the floor, the same MPI calls from C (``--no-floor`` leaves it out).

Rank 0 prints a table; ``--json`` as for ``jaxcomm.bench``, ``--plot`` draws
time per op against message size (needs matplotlib).
"""

import argparse
import sys
from collections.abc import Callable

from mpi4py import MPI

from jaxcomm import JaxComm
from jaxcomm.bench.cli import (
    floor_ratios,
    floor_routes,
    parser,
    print_notes,
    run_and_report,
    settings,
)
from jaxcomm.bench.routes import REFERENCE, Impl, JaxcommImpl, Mpi4pyImpl
from jaxcomm.bench.routes.c_floor import FLOOR

from .plots import plot, pyplot
from .routes.jax_shard_map import (
    COLLECTIVES,
    JaxCollectivesImpl,
    JaxcommShardMapImpl,
    route_name,
    start_jax_distributed,
)
from .routes.mpi4jax_functions import Mpi4jaxImpl


def start_jax_route(
    comm: MPI.Intracomm, args: argparse.Namespace, notes: dict[str, str]
) -> Callable[[], list[Impl]] | None:
    """Start ``jax.distributed`` for ``--jax``, before anything starts JAX's backends.

    Returns:
        A function giving JAX's route and jaxcomm's inside the same
        ``shard_map`` programs once the backends may start, or None, when it
        was not asked for or failed (why: in ``notes``).
    """
    if not args.jax:
        return None
    error = start_jax_distributed(comm, args.jax)
    if error is None:
        return lambda: [JaxCollectivesImpl(args.jax), JaxcommShardMapImpl()]
    notes[route_name(args.jax)] = f"not measured: {error}"
    return None


def main(argv=None):
    """Measure every library's ops; rank 0 prints the table."""
    p = parser("jaxcomm beside mpi4jax and JAX's own collectives.")
    p.add_argument(
        "--jax",
        choices=COLLECTIVES,
        default="gloo",
        help="the collectives of JAX's own route (jax.distributed, shard_map): gloo "
        "(the default) or mpi",
    )
    p.add_argument(
        "--no-jax", action="store_true", help="leave out JAX's collectives (jax.distributed)"
    )
    p.add_argument("--plot", metavar="FILE.png", help="plot time per op (needs matplotlib)")
    p.set_defaults(modes=["jit", "loop"])
    args = p.parse_args(argv)
    settings(args)  # a bad option fails before anything is measured
    if args.plot:
        try:
            pyplot()
        except RuntimeError as err:
            raise SystemExit(str(err)) from None
    comm = MPI.COMM_WORLD
    notes = {}
    if args.no_jax:
        args.jax = None
        notes["jax"] = "not measured: left out (--no-jax)"
    jax_route = start_jax_route(comm, args, notes)
    jc = JaxComm(comm)
    impls = [Mpi4pyImpl(comm), JaxcommImpl(jc)]
    try:
        impls.append(Mpi4jaxImpl(comm))
    except ImportError as err:
        notes["mpi4jax"] = f"not measured: {err}"
    if jax_route:
        impls.extend(jax_route())
    impls += floor_routes(comm, args, notes)
    print_notes(comm, notes)
    names = [impl.name for impl in impls]
    libraries = [name for name in names if name != FLOOR]
    ratios = [(name, REFERENCE) for name in libraries[1:]]
    ratios += [("jaxcomm", name) for name in libraries[2:]]
    if JaxcommShardMapImpl.name in names:
        # JAX's collectives over jaxcomm's, in the same shard_map programs.
        ratios.append((route_name(args.jax), JaxcommShardMapImpl.name))
    try:
        records = run_and_report(
            comm,
            impls,
            args,
            ratios=ratios + floor_ratios(names),
            bandwidth=(),
            title="benchmarks.compare",
            libraries=names,
            notes=notes,
        )
        if args.plot and comm.rank == 0:
            plot(args.plot, records, f"benchmarks.compare, {comm.size} ranks")
    finally:
        jc.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
