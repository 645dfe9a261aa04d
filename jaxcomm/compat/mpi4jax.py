"""mpi4jax 0.9's functions, computed by :class:`jaxcomm.JaxComm`.

``import jaxcomm.compat.mpi4jax as mpi4jax`` is the whole migration: every
public function of mpi4jax 0.9 is here with its signature, defaults and
keywords, and returns what mpi4jax returns where that differs from the
``JaxComm`` method (the non-root results of ``gather``, ``reduce`` and
``bcast``, ``scatter``'s non-root input). Each function only adapts its
arguments and result: the communication is the ``JaxComm`` method's, with
its ordering, transformations and errors.

Communicators: ``comm=None`` is a communicator of its own, as in mpi4jax (a
private clone of ``COMM_WORLD``), so a message sent with ``comm=None`` never
matches a receive on ``MPI.COMM_WORLD``, nor the other way round. Both get
their ``JaxComm`` when this module is imported (collective: every rank
imports it). Another communicator gets its ``JaxComm`` at the first call
that passes it, which is collective over that communicator (see
``docs/migration-mpi4jax.md``). Each ``JaxComm`` communicates on private
clones, so these functions never exchange messages with mpi4py code, also
on the same communicator.

Environment variables of mpi4jax, read at import: ``MPI4JAX_USE_CUDA_MPI``
chooses the data path of GPU arrays (as ``JAXCOMM_CUDA_AWARE`` does),
``MPI4JAX_DEBUG`` logs every MPI call (as ``JAXCOMM_DEBUG``); a value other
than mpi4jax's ``1``/``true``/``on`` or ``0``/``false``/``off``, or one that
contradicts ``JAXCOMM_CUDA_AWARE``, is an error. ``MPI4JAX_USE_SYCL_MPI``
set to a true value is refused (jaxcomm has no SYCL kernels), and
``MPI4JAX_SKIP_ABI_CHECK`` gets a warning: jaxcomm's check of the MPI
library always runs, and only refuses a mismatch.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

import jax.numpy as jnp
from mpi4py import MPI

from .. import _compat, _gpu, _runtime
from .._arguments import shape_dtype
from ..comm import JaxComm

__version__ = "0.9.1"
"""The mpi4jax version whose API this module implements (real code reads it)."""

__all__ = [
    "allgather",
    "allreduce",
    "alltoall",
    "barrier",
    "bcast",
    "gather",
    "has_cuda_support",
    "has_sycl_support",
    "recv",
    "reduce",
    "scan",
    "scatter",
    "send",
    "sendrecv",
]


class _NotSet:
    def __repr__(self) -> str:
        return "NOTSET"


NOTSET = _NotSet()


def _refuse_token(token: Any) -> None:
    """mpi4jax's refusal of ``token=`` (tokens went away in mpi4jax 0.8)."""
    if token is not NOTSET:
        raise RuntimeError(
            "Explicit token management is not supported for mpi4jax>=0.8.0 (nor by "
            "jaxcomm, which orders calls itself). Remove token= and unpack no tokens: "
            "write 'result = mpi4jax.allgather(x)' instead of "
            "'result, token = mpi4jax.allgather(x, token=token)'."
        )


# Communicators ----------------------------------------------------------------
#
# A JaxComm is created once per communicator and kept. It is remembered as an
# MPI attribute of the user's communicator, so that another Python object for
# the same communicator finds it, and a communicator that MPI creates later
# with the handle of a freed one does not.

_world = JaxComm(MPI.COMM_WORLD)
# mpi4jax's default communicator is a clone of COMM_WORLD of its own.
_default = JaxComm(MPI.COMM_WORLD)
_keyval = MPI.Comm.Create_keyval()
_lock = threading.Lock()


def _jaxcomm(comm: Any) -> JaxComm:
    """The ``JaxComm`` standing for mpi4jax's ``comm`` argument."""
    if comm is None:
        return _default
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py Intracomm or None, got {type(comm).__name__}")
    if comm == MPI.COMM_WORLD:
        return _world
    if comm == MPI.COMM_NULL:
        raise ValueError("comm must be a live communicator, got MPI.COMM_NULL (freed or null)")
    with _lock:
        jc = comm.Get_attr(_keyval)
        if jc is None:
            jc = JaxComm(comm)
            comm.Set_attr(_keyval, jc)
    return jc


# Operations -------------------------------------------------------------------


def allreduce(x: Any, op: MPI.Op, *, comm: MPI.Intracomm | None = None, token: Any = NOTSET) -> Any:
    """Reduce ``x`` over every rank with ``op`` and return the result on every rank.

    mpi4jax's ``allreduce`` (``MPI_Allreduce``); :meth:`jaxcomm.JaxComm.allreduce`.
    Differentiable for every op jaxcomm differentiates (mpi4jax: ``MPI.SUM`` only).
    """
    _refuse_token(token)
    return _jaxcomm(comm).allreduce(x, op=op)


def reduce(
    x: Any, op: MPI.Op, root: int, *, comm: MPI.Intracomm | None = None, token: Any = NOTSET
) -> Any:
    """Reduce ``x`` over every rank onto ``root``; other ranks get ``x`` back, as in mpi4jax.

    ``MPI_Reduce``; :meth:`jaxcomm.JaxComm.reduce` returns zeros off root instead.
    """
    _refuse_token(token)
    jc = _jaxcomm(comm)
    result = jc.reduce(x, op=op, root=root)
    return result if jc.rank == root else x


def scan(x: Any, op: MPI.Op, *, comm: MPI.Intracomm | None = None, token: Any = NOTSET) -> Any:
    """Inclusive prefix reduction over the ranks (``MPI_Scan``); :meth:`jaxcomm.JaxComm.scan`."""
    _refuse_token(token)
    return _jaxcomm(comm).scan(x, op=op)


def bcast(x: Any, root: int, *, comm: MPI.Intracomm | None = None, token: Any = NOTSET) -> Any:
    """Broadcast ``x`` from ``root``; ``root`` gets ``x`` itself back, as in mpi4jax.

    ``MPI_Bcast``; :meth:`jaxcomm.JaxComm.bcast`. Other ranks' ``x`` gives the
    shape and dtype only.
    """
    _refuse_token(token)
    jc = _jaxcomm(comm)
    result = jc.bcast(x, root=root)
    return x if jc.rank == root else result


def barrier(*, comm: MPI.Intracomm | None = None, token: Any = NOTSET) -> list:
    """Wait until every rank has arrived (``MPI_Barrier``); :meth:`jaxcomm.JaxComm.barrier`.

    Returns an empty list, as mpi4jax does.
    """
    _refuse_token(token)
    _jaxcomm(comm).barrier()
    return []


def allgather(x: Any, *, comm: MPI.Intracomm | None = None, token: Any = NOTSET) -> Any:
    """Every rank's ``x``, stacked along a new leading axis, on every rank.

    ``MPI_Allgather``; :meth:`jaxcomm.JaxComm.allgather`.
    """
    _refuse_token(token)
    return _jaxcomm(comm).allgather(x)


def gather(x: Any, root: int, *, comm: MPI.Intracomm | None = None, token: Any = NOTSET) -> Any:
    """Every rank's ``x`` stacked on ``root``; other ranks get ``x`` back, as in mpi4jax.

    ``MPI_Gather``; :meth:`jaxcomm.JaxComm.gather` gives every rank the
    stacked shape (zeros off root) instead.
    """
    _refuse_token(token)
    jc = _jaxcomm(comm)
    result = jc.gather(x, root=root)
    return result if jc.rank == root else x


def scatter(x: Any, root: int, *, comm: MPI.Intracomm | None = None, token: Any = NOTSET) -> Any:
    """Row ``r`` of root's ``x`` on rank ``r``.

    ``MPI_Scatter``; :meth:`jaxcomm.JaxComm.scatter`. As in mpi4jax, root
    passes ``(size, *s)`` and the other ranks an array of the result's shape
    ``s`` (its values are not read).

    Raises:
        ValueError: on root, if ``x``'s leading axis is not the communicator's size.
    """
    _refuse_token(token)
    jc = _jaxcomm(comm)
    x = jnp.asarray(x)
    if jc.rank == root:
        _check_rows("Scatter", x, jc.size)
        full = x
    else:
        # Made from x (whose values MPI does not read off root), so that under
        # vmap it is batched exactly when root's x is, and every rank's
        # scatter has the same batched shape.
        full = jnp.broadcast_to(x, (jc.size, *x.shape))
    return jc.scatter(full, root=root)


def alltoall(x: Any, *, comm: MPI.Intracomm | None = None, token: Any = NOTSET) -> Any:
    """Row ``r`` of every rank's ``x`` to rank ``r`` (``MPI_Alltoall``); :meth:`jaxcomm.JaxComm.alltoall`.

    Raises:
        ValueError: if ``x``'s leading axis is not the communicator's size.
    """
    _refuse_token(token)
    jc = _jaxcomm(comm)
    x = jnp.asarray(x)
    _check_rows("Alltoall", x, jc.size)
    return jc.alltoall(x)


def _check_rows(op: str, x: Any, size: int) -> None:
    """mpi4jax's check (and message) for an input with one row per rank."""
    if x.ndim == 0 or x.shape[0] != size:
        raise ValueError(
            f"{op} input must have shape (nproc, ...): got shape {tuple(x.shape)} "
            f"on a communicator of {size} ranks"
        )


def send(
    x: Any, dest: int, *, tag: int = 0, comm: MPI.Intracomm | None = None, token: Any = NOTSET
) -> list:
    """Send ``x`` to rank ``dest`` (``MPI_Send``); :meth:`jaxcomm.JaxComm.send`.

    Returns an empty list, as mpi4jax does.
    """
    _refuse_token(token)
    _jaxcomm(comm).send(x, dest, tag=tag)
    return []


def recv(
    x: Any,
    source: int = MPI.ANY_SOURCE,
    *,
    tag: int = MPI.ANY_TAG,
    comm: MPI.Intracomm | None = None,
    status: MPI.Status | None = None,
    token: Any = NOTSET,
) -> Any:
    """Receive an array shaped like ``x`` (``MPI_Recv``); :meth:`jaxcomm.JaxComm.recv`.

    ``status``, an ``MPI.Status``, is filled with the message's source, tag
    and size, eagerly and in compiled code (when it runs).
    """
    _refuse_token(token)
    return _jaxcomm(comm).recv(x, source, tag, status=status)


def sendrecv(
    sendbuf: Any,
    recvbuf: Any,
    source: int,
    dest: int,
    *,
    sendtag: int = 0,
    recvtag: int = MPI.ANY_TAG,
    comm: MPI.Intracomm | None = None,
    status: MPI.Status | None = None,
    token: Any = NOTSET,
) -> Any:
    """Send ``sendbuf`` to ``dest`` and receive an array shaped like ``recvbuf`` from ``source``.

    ``MPI_Sendrecv``; :meth:`jaxcomm.JaxComm.sendrecv`. As in mpi4jax,
    ``recvbuf`` may differ from ``sendbuf`` in shape and dtype: the message
    then goes out with :meth:`jaxcomm.JaxComm.isend` while
    :meth:`jaxcomm.JaxComm.recv` takes the other, which cannot deadlock
    either.
    """
    _refuse_token(token)
    jc = _jaxcomm(comm)
    sendbuf = jnp.asarray(sendbuf)
    if shape_dtype(recvbuf, "recvbuf") == (tuple(sendbuf.shape), jnp.dtype(sendbuf.dtype)):
        return jc.sendrecv(sendbuf, recvbuf, source, dest, sendtag, recvtag, status=status)
    request = jc.isend(sendbuf, dest, sendtag)
    result = jc.recv(recvbuf, source, recvtag, status=status)
    jc.wait(request)
    return result


def has_cuda_support() -> bool:
    """Whether GPU arrays can be communicated: CUDA kernels built and a CUDA jax.

    ``True`` when jaxcomm's CUDA kernels are installed and JAX has a CUDA
    backend: its GPUs when JAX has started its backends, else an installed
    CUDA plugin (``jax[cuda12]``, ``jax[cuda13]``). It starts no backend, so
    a later ``jax.distributed.initialize()`` still works.
    """
    if not _runtime.CUDA_BUILT:
        return False
    if _compat.backends_initialized():
        return bool(_gpu.cuda_info()["gpus"])
    return _runtime.cuda_plugin_installed()


def has_sycl_support() -> bool:
    """Always False: jaxcomm has CPU and CUDA kernels only."""
    return False


# mpi4jax's environment variables ---------------------------------------------------


def _env_flag(name: str) -> bool | None:
    """mpi4jax's reading of a switch: None when unset, else its truth (or an error)."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return None
    if value in ("1", "true", "on"):
        return True
    if value in ("0", "false", "off"):
        return False
    raise ValueError(
        f"{name}={os.environ[name]!r}: jaxcomm.compat.mpi4jax reads it as mpi4jax does, "
        "and accepts 1, true or on, or 0, false or off"
    )


def _apply_environment() -> None:
    cuda_mpi = _env_flag("MPI4JAX_USE_CUDA_MPI")
    if cuda_mpi is not None:
        own = os.environ.get("JAXCOMM_CUDA_AWARE", "").strip()
        if own and (own == "1") != cuda_mpi:
            raise ValueError(
                f"MPI4JAX_USE_CUDA_MPI={os.environ['MPI4JAX_USE_CUDA_MPI']} contradicts "
                f"JAXCOMM_CUDA_AWARE={own}: set one of them"
            )
        _gpu.apply_data_path(cuda_mpi, "MPI4JAX_USE_CUDA_MPI")
    if _env_flag("MPI4JAX_DEBUG"):
        _runtime.set_debug(True)
    if _env_flag("MPI4JAX_USE_SYCL_MPI"):
        raise ValueError(
            "MPI4JAX_USE_SYCL_MPI is set, but jaxcomm has CPU and CUDA kernels only (no SYCL); "
            "unset it"
        )
    if _env_flag("MPI4JAX_SKIP_ABI_CHECK"):
        warnings.warn(
            "MPI4JAX_SKIP_ABI_CHECK has no effect on jaxcomm: its check that the kernels were "
            "built against the MPI library mpi4py runs always applies, and only refuses a "
            "mismatch",
            stacklevel=2,
        )


_apply_environment()
