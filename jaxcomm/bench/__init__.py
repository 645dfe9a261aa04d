"""Latency and bandwidth of every jaxcomm op, beside mpi4py, in one run.

Run it under MPI on your own machines, after ``pip install`` (from outside a
source tree, whose jaxcomm has no compiled kernels)::

    mpiexec -n 2 python -m jaxcomm.bench [--quick] [--json FILE] [--no-progress]

Every op is timed in three modes, each beside the same MPI operation done by
mpi4py on NumPy buffers:

- ``jit``: one op per jitted call, waiting for each call's result;
- ``loop``: many ops in one jitted ``lax.fori_loop`` whose body is the op on
  the carry and ``* 0.5`` (mpi4py: the MPI call, then ``np.multiply`` into
  preallocated buffers);
- ``eager``: the method called outside ``jit``.

``jit`` and ``eager`` also time a plain jitted function without MPI
(``x + 1`` on the same array, tiled or cut to the op's output shape where that
differs), the reference of the dispatch targets. Every mode also times the
floor: the same MPI calls from a small C program (``routes/c_floor.c``, which
ships in the package) compiled at run time with the MPI's ``mpicc``; where
there is none, one line says so and the rest of the run goes on. ``--again``
times mpi4py and jaxcomm a second time, as routes of their own, so that the
summary can say how far the same code moves in the run. Each op's result is
first checked against mpi4py's; a wrong op is reported as wrong and not timed.

The package, one module per concern:

- :mod:`~jaxcomm.bench.operations`: the benchmarked ops and their messages;
- :mod:`~jaxcomm.bench.routes`: the ways of doing them (mpi4py, jaxcomm,
  plain jit, the C floor), one module each;
- :mod:`~jaxcomm.bench.measure`: the result check and the timing
  (:func:`run`, :func:`measure`, :class:`Record`), on
  :mod:`~jaxcomm.bench.timing`'s clock loop;
- :mod:`~jaxcomm.bench.report`: tables, summary, metadata and JSON;
- :mod:`~jaxcomm.bench.quiet`: whether the machine was quiet (the CPU time
  other processes and the hypervisor took during the run);
- :mod:`~jaxcomm.bench.native`: the C floor built with ``mpicc`` and loaded
  on every rank;
- :mod:`~jaxcomm.bench.cli`: ``python -m jaxcomm.bench``.

The research benchmarks (mpi4jax and JAX's collectives beside jaxcomm, rank
sweeps, the cost model, soak runs, the GPU reference, plots) live in a source
checkout's ``benchmarks/`` folder, built on this core; see docs/benchmarks.md.

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
from .report import format_table, metadata, summary, table, write_json
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
    "ring",
    "run",
    "run_and_report",
    "settings",
    "sizes_between",
    "summary",
    "table",
    "write_json",
]
