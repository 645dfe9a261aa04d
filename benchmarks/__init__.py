"""The research benchmarks of jaxcomm, run from a source checkout.

Each command is a module, run from the repository's root against the
*installed* jaxcomm (``pip install .`` first)::

    mpiexec -n 2 python -m benchmarks.soak --ops 5000
    python -m benchmarks.ranks --ranks 16        # starts mpiexec itself

The commands: :mod:`~benchmarks.compare` (mpi4jax and JAX's collectives
beside jaxcomm), :mod:`~benchmarks.scaling` (``python -m jaxcomm.bench`` at 1
to 8 ranks), :mod:`~benchmarks.model` (a cost model checked against
measurements and extrapolated to many nodes), :mod:`~benchmarks.ranks` (every
op family at many ranks, memory per rank), :mod:`~benchmarks.soak`,
:mod:`~benchmarks.neighbor`, :mod:`~benchmarks.overlap`,
:mod:`~benchmarks.eager_memory`, :mod:`~benchmarks.nan_minmax`,
:mod:`~benchmarks.trace_overhead` (what the timeline recorder costs) and
:mod:`~benchmarks.gpu` (with its C++ reference, ``gpu_reference.cc``). They
build on the measurement core that ships in the package, ``jaxcomm.bench``.
"""

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# `python -m benchmarks.X` puts the repository's root first on sys.path, where
# the jaxcomm package has no compiled kernels: take the installed one. This
# package's own modules are found through its __path__, not sys.path.
sys.path[:] = [p for p in sys.path if pathlib.Path(p or os.getcwd()).resolve() != ROOT]
