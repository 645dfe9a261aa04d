"""jaxcomm beside mpi4jax and JAX's own multi-process collectives, in one run.

Run:  mpiexec -n 2 python -m jaxcomm.bench.compare [options of python -m jaxcomm.bench]

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

Rank 0 prints a table; ``--json`` and ``--plot`` as for ``jaxcomm.bench``.
"""

import sys

from mpi4py import MPI

from ..comm import JaxComm
from .cli import (
    floor_ratios,
    floor_routes,
    parser,
    print_notes,
    run_and_report,
    settings,
    start_jax_route,
)
from .routes import REFERENCE, JaxcommImpl, Mpi4pyImpl
from .routes.c_floor import FLOOR
from .routes.mpi4jax_functions import Mpi4jaxImpl


def main(argv=None):
    """Measure every library's ops; rank 0 prints the table."""
    p = parser("jaxcomm beside mpi4jax and JAX's own collectives.")
    p.add_argument(
        "--no-jax", action="store_true", help="leave out JAX's collectives (jax.distributed)"
    )
    p.set_defaults(modes=["jit", "loop"], jax="gloo")
    args = p.parse_args(argv)
    settings(args)  # a bad option fails before anything is measured
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
    try:
        run_and_report(
            comm,
            impls,
            args,
            ratios=[(name, REFERENCE) for name in libraries[1:]]
            + [("jaxcomm", name) for name in libraries[2:]]
            + floor_ratios(names),
            bandwidth=(),
            title="jaxcomm.bench.compare",
            libraries=names,
            notes=notes,
        )
    finally:
        jc.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
