"""The routes a benchmarked operation can take: one module per library or way.

Every route is an :class:`Impl` (a column of the table); those whose ops are
JAX functions derive from :class:`JaxImpl` and give only ``function(op)``:

- :mod:`.mpi4py_buffers`: the reference, mpi4py's buffer methods on NumPy;
- :mod:`.jaxcomm_methods`: jaxcomm's :class:`~jaxcomm.JaxComm` methods;
- :mod:`.plain_jit`: a jitted ``x + 1`` without MPI, the dispatch reference;
- :mod:`.c_floor`: the floor, the reference's MPI calls from C (``c_floor.c``,
  built at bench time with the MPI's ``mpicc``).

A new route is a module with one :class:`Impl` subclass, added to the list of
implementations that a command measures. The routes of other libraries
(mpi4jax, JAX's own collectives over ``jax.distributed``) are in the source
checkout's ``benchmarks/routes/``, beside ``benchmarks/compare.py``.
"""

from .base import Impl, JaxImpl
from .jaxcomm_methods import JaxcommImpl
from .mpi4py_buffers import REFERENCE, Mpi4pyImpl
from .plain_jit import PLAIN, PlainJitImpl

__all__ = [
    "PLAIN",
    "REFERENCE",
    "Impl",
    "JaxImpl",
    "JaxcommImpl",
    "Mpi4pyImpl",
    "PlainJitImpl",
]
