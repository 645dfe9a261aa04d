"""jaxcomm: MPI communication for JAX programs, from inside ``jax.jit``.

``JaxComm(MPI.COMM_WORLD)`` gives a communicator object whose methods
(``allreduce``, ``bcast``, ``send``, ``recv``, ...) move JAX arrays between
MPI ranks without copies, eagerly and in compiled code, always in program
order.
"""

# First: _compat checks the JAX internals jaxcomm orders its calls with, and
# must refuse a jax without them before anything else imports jax.extend.
from . import _compat  # noqa: F401
from ._abort import abort_on_exception
from ._distributed import initialize_jax_distributed
from ._gpu import bind_local_gpu, cuda_info, set_cuda_aware
from ._runtime import (
    build_info,
    pipeline_bytes,
    set_check,
    set_debug,
    set_pipeline_bytes,
    set_timeout,
    sync,
)
from ._version import __version__
from .comm import JaxComm
from .ops.nonblocking import Request
from .trace import start_from_environment as _start_trace_from_environment
from .trace import trace

__all__ = [
    "JaxComm",
    "Request",
    "__version__",
    "abort_on_exception",
    "bind_local_gpu",
    "build_info",
    "cuda_info",
    "initialize_jax_distributed",
    "pipeline_bytes",
    "set_check",
    "set_cuda_aware",
    "set_debug",
    "set_pipeline_bytes",
    "set_timeout",
    "sync",
    "trace",
]

_start_trace_from_environment()
