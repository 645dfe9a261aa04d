"""Latency and bandwidth of every jaxcomm op, beside mpi4py, in one run; and the
other benchmarks of jaxcomm.

Run it under MPI, from outside the source tree (which has no compiled
kernels)::

    mpiexec -n 2 python -m jaxcomm.bench [--quick] [--json FILE] [--plot FILE.png]

Every op is timed in three modes, each beside the same MPI operation done by
mpi4py on NumPy buffers:

- ``jit``: one op per jitted call, waiting for each call's result;
- ``loop``: many ops in one jitted ``lax.fori_loop`` whose body is the op on
  the carry and ``* 0.5`` (mpi4py: the MPI call, then ``np.multiply`` into
  preallocated buffers);
- ``eager``: the method called outside ``jit``.

``jit`` and ``eager`` also time a plain jitted function without MPI
(``x + 1`` on the same array, tiled or cut to the op's output shape where that
differs), the reference of the dispatch targets. Every
mode also times the floor: the same MPI calls from a small C program built
with the MPI's ``mpicc`` (left out, with a line saying why, where there is
none); ``--jax`` adds JAX's own route (``jax.distributed`` and ``shard_map``
collectives); ``--again`` times mpi4py and jaxcomm a second time, as routes
of their own, so that the summary can say how far the same code moves in the
run. Each op's result is first checked against mpi4py's; a wrong op is
reported as wrong and not timed.

The package, one module per concern:

- :mod:`~jaxcomm.bench.operations`: the benchmarked ops and their messages;
- :mod:`~jaxcomm.bench.routes`: the ways of doing them (mpi4py, jaxcomm,
  plain jit, mpi4jax, JAX's collectives, the C floor), one module each;
- :mod:`~jaxcomm.bench.measure`: the result check and the timing
  (:func:`run`, :func:`measure`, :class:`Record`), on
  :mod:`~jaxcomm.bench.timing`'s clock loop;
- :mod:`~jaxcomm.bench.report`: tables, summary, metadata, JSON and plots;
- :mod:`~jaxcomm.bench.quiet`: whether the machine was quiet (the CPU time
  other processes and the hypervisor took during the run);
- :mod:`~jaxcomm.bench.cli`: ``python -m jaxcomm.bench``;
- commands of their own, each ``python -m jaxcomm.bench.<name>``:
  :mod:`~jaxcomm.bench.compare` (mpi4jax and JAX's collectives beside
  jaxcomm), :mod:`~jaxcomm.bench.scaling` (this command at 1 to 8 ranks),
  :mod:`~jaxcomm.bench.model` (a cost model checked against measurements
  and extrapolated to many nodes), :mod:`~jaxcomm.bench.soak`, :mod:`~jaxcomm.bench.eager_memory`,
  :mod:`~jaxcomm.bench.nan_minmax`, :mod:`~jaxcomm.bench.overlap` and
  :mod:`~jaxcomm.bench.gpu`.

The measurement core is importable: it returns :class:`Record` objects, and
an implementation is an :class:`Impl` (:class:`JaxImpl` for JAX functions).
"""

from .cli import main, parser, run_and_report, settings
from .measure import Record, measure, run
from .operations import (
    DTYPE,
    MODES,
    OPS,
    Op,
    check_data,
    fori,
    input_shape,
    loop_step,
    loop_step_numpy,
    partner,
    pingpong,
    ring,
)
from .report import format_table, metadata, plot, summary, table, write_json
from .routes import (
    PLAIN,
    REFERENCE,
    Impl,
    JaxcommImpl,
    JaxImpl,
    Mpi4pyImpl,
    PlainJitImpl,
)
from .sizes import (
    DEFAULT_SIZES,
    KIB,
    MIB,
    QUICK_SIZES,
    format_size,
    parse_size,
    sizes_between,
)

__all__ = [
    "DEFAULT_SIZES",
    "DTYPE",
    "KIB",
    "MIB",
    "MODES",
    "OPS",
    "PLAIN",
    "QUICK_SIZES",
    "REFERENCE",
    "Impl",
    "JaxImpl",
    "JaxcommImpl",
    "Mpi4pyImpl",
    "Op",
    "PlainJitImpl",
    "Record",
    "check_data",
    "fori",
    "format_size",
    "format_table",
    "input_shape",
    "loop_step",
    "loop_step_numpy",
    "main",
    "measure",
    "metadata",
    "parse_size",
    "parser",
    "partner",
    "pingpong",
    "plot",
    "ring",
    "run",
    "run_and_report",
    "settings",
    "sizes_between",
    "summary",
    "table",
    "write_json",
]
