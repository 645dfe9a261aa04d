"""``JaxComm``: the communicator object users call MPI through.

Every method validates its arguments here, turns them into integer
parameters and delegates to a primitive in ``jaxcomm.ops``.
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from . import ops
from ._runtime import check_thread_level, sync
from .ops._base import ALLOWED_DTYPES, REDUCTION_OPS, SUPPORTED_DTYPES

ArrayLike = Any  # a JAX or NumPy array, or a Python scalar

_LOGICAL = ("LAND", "LOR", "LXOR")

# Keeps every MPI.Status handed to jaxcomm alive: compiled code holds the
# address of its MPI_Status and writes there each time it runs.
_pinned_statuses: dict[int, MPI.Status] = {}


def _as_array(x: ArrayLike, name: str) -> jax.Array:
    if isinstance(x, (MPI.Status, str, bytes)) or x is None:
        raise TypeError(f"{name} must be an array or a scalar, got {type(x).__name__}")
    try:
        array = x if isinstance(x, jax.Array) else jnp.asarray(x)
    except TypeError as err:
        raise TypeError(f"{name} must be an array or a scalar, got {type(x).__name__}") from err
    _check_dtype(array.dtype, name)
    return array


def _check_dtype(dtype, name: str) -> None:
    if np.dtype(dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {dtype}, which jaxcomm cannot send")


def _shape_dtype(x: Any, name: str) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of an array, tracer, ShapeDtypeStruct or scalar."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        shape = tuple(int(d) for d in x.shape)
        dtype = np.dtype(jax.dtypes.canonicalize_dtype(x.dtype))
    else:
        array = _as_array(x, name)
        shape, dtype = array.shape, np.dtype(array.dtype)
    _check_dtype(dtype, name)
    return shape, dtype


def _static_int(value: Any, name: str) -> int:
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} must be a static Python int, but got a traced value; "
            "compute it outside jax.jit or mark it static"
        )
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def _static_bool(value: Any, name: str) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be a static bool, got {type(value).__name__}")


def _leading_axis(x: jax.Array, why: str) -> int:
    if x.ndim == 0:
        raise ValueError(f"x must have a leading axis {why}, got a 0-d array")
    return x.shape[0]


def _reduction_code(op: Any, dtype: np.dtype) -> int:
    if not isinstance(op, MPI.Op):
        raise TypeError(f"op must be a predefined mpi4py MPI.Op such as MPI.SUM, got {op!r}")
    for code, (name, predefined) in enumerate(REDUCTION_OPS):
        if op == predefined:
            if dtype not in ALLOWED_DTYPES[name]:
                raise TypeError(f"op MPI.{name} is not defined for dtype {dtype}")
            return code
    raise ValueError(
        "op must be one of the predefined reductions "
        + ", ".join(f"MPI.{name}" for name, _ in REDUCTION_OPS)
        + "; user-defined MPI.Op objects are not supported"
    )


def _status_address(status: MPI.Status | None) -> int:
    if status is None:
        return 0
    if not isinstance(status, MPI.Status):
        raise TypeError(f"status must be an MPI.Status or None, got {type(status).__name__}")
    address = MPI._addressof(status)
    _pinned_statuses[address] = status
    return address


def _wait_if_eager(result: jax.Array, status: MPI.Status | None) -> jax.Array:
    # An eager call returns before the kernel has run; a status the caller
    # reads next must already be filled.
    if status is not None and not isinstance(result, jax.core.Tracer):
        result.block_until_ready()
    return result


class JaxComm:
    """An MPI communicator for JAX arrays, usable eagerly and inside ``jax.jit``.

    ``JaxComm(comm)`` clones ``comm``, so jaxcomm's messages can never match
    receives posted by plain mpi4py code on the original communicator. Every
    method call is an MPI call made in program order on every rank, also from
    compiled code, loops and conditionals; there are no tokens to manage.

    Args:
        comm: any mpi4py ``Intracomm`` (``COMM_WORLD``, a split or a Cartesian
            communicator). Defaults to ``MPI.COMM_WORLD``.

    Raises:
        TypeError: if ``comm`` is not an mpi4py ``Intracomm``.
        ValueError: if ``comm`` is ``MPI.COMM_NULL``.
        RuntimeError: if MPI runs below ``MPI_THREAD_MULTIPLE``.

    Example:
        >>> from mpi4py import MPI
        >>> from jaxcomm import JaxComm
        >>> jc = JaxComm(MPI.COMM_WORLD)
        >>> total = jax.jit(jc.allreduce)(jnp.ones(3))
    """

    def __init__(self, comm: MPI.Intracomm | None = None) -> None:
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(f"comm must be an mpi4py Intracomm, got {type(comm).__name__}")
        if comm == MPI.COMM_NULL:
            raise ValueError("comm is MPI.COMM_NULL")
        check_thread_level()
        self._comm: MPI.Intracomm | None = comm.Clone()
        # Failures come back to jaxcomm's kernels, which raise them in Python.
        self._comm.Set_errhandler(MPI.ERRORS_RETURN)
        self._handle = self._comm.py2f()
        self._rank = self._comm.Get_rank()
        self._size = self._comm.Get_size()
        # MPI only guarantees TAG_UB on MPI_COMM_WORLD (Open MPI leaves it unset
        # on split and Cartesian communicators); the bound is the same for all.
        tag_ub = self._comm.Get_attr(MPI.TAG_UB)
        self._tag_ub = tag_ub if tag_ub is not None else MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)

    # Communicator management -------------------------------------------------

    @property
    def comm(self) -> MPI.Intracomm:
        """The private mpi4py duplicate this object communicates on."""
        self._live()
        return self._comm

    @property
    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self._rank

    @property
    def size(self) -> int:
        """The number of processes in the communicator."""
        return self._size

    @property
    def freed(self) -> bool:
        """Whether :meth:`free` has been called."""
        return self._comm is None

    def free(self) -> None:
        """Wait for pending jaxcomm work, then free the duplicate communicator.

        Collective (``MPI_Comm_free``): call it on every rank. Calling it twice
        is harmless. Methods called afterwards raise ``RuntimeError``; compiled
        functions that captured this communicator must not be run again.
        """
        if self._comm is not None:
            sync()
            self._comm.Free()
            self._comm = None

    def __enter__(self) -> JaxComm:
        return self

    def __exit__(self, *exc_info) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"rank {self._rank} of {self._size}"
        return f"<JaxComm {state}>"

    def _live(self) -> int:
        if self._comm is None:
            raise RuntimeError("this JaxComm has been freed")
        return self._handle

    def _peer(self, value: Any, name: str, *, any_source: bool = False) -> int:
        rank = _static_int(value, name)
        if rank == MPI.PROC_NULL or (any_source and rank == MPI.ANY_SOURCE):
            return rank
        if not 0 <= rank < self._size:
            raise ValueError(f"{name}={rank} is not a rank of this {self._size}-process communicator")
        return rank

    def _root(self, value: Any) -> int:
        root = _static_int(value, "root")
        if not 0 <= root < self._size:
            raise ValueError(f"root={root} is not a rank of this {self._size}-process communicator")
        return root

    def _per_rank(self, value: Any, name: str) -> list[Any]:
        """The entries of a static sequence with one entry per rank."""
        if isinstance(value, jax.core.Tracer):
            raise TypeError(
                f"{name} must be a static sequence, but got a traced value; "
                "pass a Python list or tuple known when the function is traced"
            )
        try:
            items = list(value)
        except TypeError:
            raise TypeError(f"{name} must be a sequence, got {type(value).__name__}") from None
        if len(items) != self._size:
            raise ValueError(
                f"{name} has {len(items)} entries; it needs one per rank ({self._size})"
            )
        return items

    def _counts(self, value: Any, name: str) -> tuple[int, ...]:
        """One static, non-negative row count per rank."""
        items = self._per_rank(value, name)
        counts = tuple(_static_int(c, f"{name}[{i}]") for i, c in enumerate(items))
        for i, count in enumerate(counts):
            if count < 0:
                raise ValueError(f"{name}[{i}]={count} is negative")
        return counts

    def _own_rows(self, x: jax.Array, counts: tuple[int, ...]) -> None:
        rows = _leading_axis(x, "of counts[rank] rows")
        if rows != counts[self._rank]:
            raise ValueError(
                f"x has {rows} rows on rank {self._rank}, but counts[{self._rank}] "
                f"is {counts[self._rank]}"
            )

    def _split_rows(self, x: jax.Array, tiled: bool) -> None:
        rows = _leading_axis(x, "to split among the ranks")
        if not tiled and rows != self._size:
            raise ValueError(
                f"x has leading axis {rows}; with tiled=False it needs one entry "
                f"per rank ({self._size})"
            )
        if tiled and rows % self._size:
            raise ValueError(
                f"x has leading axis {rows}, which does not split into {self._size} "
                "equal chunks"
            )

    def _tag(self, value: Any, name: str, *, any_tag: bool = False) -> int:
        tag = _static_int(value, name)
        if any_tag and tag == MPI.ANY_TAG:
            return tag
        if not 0 <= tag <= self._tag_ub:
            raise ValueError(f"{name}={tag} is outside the valid tag range 0..{self._tag_ub}")
        return tag

    # Collectives -------------------------------------------------------------

    def allreduce(self, x: ArrayLike, op: MPI.Op = MPI.SUM) -> jax.Array:
        """Combine ``x`` from every rank with ``op``; every rank gets the result.

        Wraps ``MPI_Allreduce``. Works eagerly and under ``jit``, in loops and
        conditionals. float16 and bfloat16 reduce through jaxcomm's own MPI ops
        (accumulating each pair in float32).

        Args:
            x: array or scalar, the same shape and dtype on every rank.
            op: a predefined ``MPI.Op``: SUM, PROD, MIN, MAX (numbers), LAND,
                LOR, LXOR (integers and bool; integers count as true when
                nonzero and the result is 0 or 1), BAND, BOR, BXOR (integers).

        Returns:
            A new array of ``x``'s shape and dtype.

        Raises:
            TypeError: for a non-array ``x``, an unsupported dtype, or an op
                MPI does not define for the dtype (such as SUM on bool).
            ValueError: for a user-defined ``MPI.Op``.
        """
        handle = self._live()
        x = _as_array(x, "x")
        code = _reduction_code(op, np.dtype(x.dtype))
        if REDUCTION_OPS[code][0] in _LOGICAL and x.dtype != bool:
            # MPI leaves a single process's integers as they are; 0/1 inputs
            # give the same 0/1 answer on any number of ranks.
            x = (x != 0).astype(x.dtype)
        return ops.allreduce(x, op=code, comm=handle)

    def bcast(self, x: ArrayLike, root: int = 0) -> jax.Array:
        """Send root's ``x`` to every rank.

        Wraps ``MPI_Bcast``. Every rank passes an array of the same shape and
        dtype; only root's values are read. Works eagerly and under ``jit``.

        Args:
            x: array or scalar.
            root: the rank whose ``x`` is broadcast (a static int).

        Returns:
            A new array holding root's ``x``, on every rank.

        Raises:
            TypeError: for a non-array ``x`` or a non-int or traced ``root``.
            ValueError: if ``root`` is not a rank of the communicator.
        """
        handle = self._live()
        x = _as_array(x, "x")
        return ops.bcast(x, root=self._root(root), comm=handle)

    def barrier(self) -> None:
        """Block until every rank has reached this barrier.

        Wraps ``MPI_Barrier``. Eagerly it returns once the barrier completed;
        under ``jit`` the barrier is ordered among the function's other MPI
        calls.
        """
        handle = self._live()
        ops.barrier(comm=handle)

    def allgather(self, x: ArrayLike, *, tiled: bool = False) -> jax.Array:
        """Collect ``x`` from every rank on every rank, in rank order.

        Wraps ``MPI_Allgather``. Every rank passes the same shape and dtype.
        Works eagerly and under ``jit``, in loops and conditionals.

        Args:
            x: array or scalar.
            tiled: as in ``jax.lax.all_gather``: ``False`` stacks the arrays
                along a new leading axis, ``True`` concatenates them along
                ``x``'s leading axis.

        Returns:
            A new array of shape ``(size, *x.shape)``, or
            ``(size * x.shape[0], *x.shape[1:])`` when ``tiled``.

        Raises:
            TypeError: for a non-array ``x`` or a non-bool ``tiled``.
            ValueError: for ``tiled=True`` with a 0-d ``x``.

        Example:
            With 4 ranks, each passing ``jnp.full(2, rank)``:

            >>> jc.allgather(jnp.full(2, jc.rank)).shape
            (4, 2)
            >>> jc.allgather(jnp.full(2, jc.rank), tiled=True)
            Array([0, 0, 1, 1, 2, 2, 3, 3], dtype=int32)
        """
        handle = self._live()
        x = _as_array(x, "x")
        tiled = _static_bool(tiled, "tiled")
        if tiled:
            _leading_axis(x, "to concatenate along with tiled=True")
        return ops.allgather(x, size=self._size, tiled=tiled, comm=handle)

    def gather(self, x: ArrayLike, root: int = 0, *, tiled: bool = False) -> jax.Array:
        """Collect ``x`` from every rank on ``root``, in rank order.

        Wraps ``MPI_Gather``. Every rank passes the same shape and dtype and
        gets the same output shape: root gets the gathered arrays, the other
        ranks zeros. Works eagerly and under ``jit``.

        Args:
            x: array or scalar.
            root: the rank that receives (a static int).
            tiled: ``False`` stacks along a new leading axis, ``True``
                concatenates along ``x``'s leading axis (see :meth:`allgather`).

        Returns:
            A new array of shape ``(size, *x.shape)``, or
            ``(size * x.shape[0], *x.shape[1:])`` when ``tiled``: the gathered
            values on root, zeros elsewhere.

        Raises:
            TypeError: for a non-array ``x``, a non-int or traced ``root`` or a
                non-bool ``tiled``.
            ValueError: for a ``root`` out of range, or ``tiled=True`` with a
                0-d ``x``.

        Example:
            With 4 ranks, each passing ``jnp.asarray(rank)``:

            >>> jc.gather(jnp.asarray(jc.rank), root=1)
            Array([0, 1, 2, 3], dtype=int32)   # on rank 1; [0, 0, 0, 0] elsewhere
        """
        handle = self._live()
        x = _as_array(x, "x")
        tiled = _static_bool(tiled, "tiled")
        if tiled:
            _leading_axis(x, "to concatenate along with tiled=True")
        return ops.gather(x, root=self._root(root), size=self._size, tiled=tiled, comm=handle)

    def scatter(self, x: ArrayLike, root: int = 0, *, tiled: bool = False) -> jax.Array:
        """Send one piece of root's ``x`` to each rank: rank ``r`` gets piece ``r``.

        Wraps ``MPI_Scatter``. Every rank passes an array of the same shape
        and dtype; only root's values are read. Works eagerly and under
        ``jit``.

        Args:
            x: array with a leading axis of length ``size`` (``tiled=False``)
                or a multiple of ``size`` (``tiled=True``).
            root: the rank whose ``x`` is scattered (a static int).
            tiled: ``False``: rank ``r`` gets ``x[r]``; ``True``: the leading
                axis is split into ``size`` equal chunks and rank ``r`` gets
                chunk ``r`` (as in ``jax.lax.psum_scatter``).

        Returns:
            A new array of shape ``x.shape[1:]``, or
            ``(x.shape[0] // size, *x.shape[1:])`` when ``tiled``.

        Raises:
            TypeError: for a non-array ``x``, a non-int or traced ``root`` or a
                non-bool ``tiled``.
            ValueError: for a ``root`` out of range, or a leading axis that
                does not fit the rules above.

        Example:
            With 4 ranks:

            >>> jc.scatter(jnp.arange(8.0), root=0, tiled=True)
            Array([2., 3.], dtype=float32)   # on rank 1: [2r, 2r + 1] on rank r
        """
        handle = self._live()
        x = _as_array(x, "x")
        tiled = _static_bool(tiled, "tiled")
        self._split_rows(x, tiled)
        return ops.scatter(x, root=self._root(root), size=self._size, tiled=tiled, comm=handle)

    def alltoall(self, x: ArrayLike, *, tiled: bool = False) -> jax.Array:
        """Send block ``r`` of ``x``'s leading axis to rank ``r``, from every rank.

        Wraps ``MPI_Alltoall``. Rank ``r``'s result holds, in rank order, the
        ``r``-th block of every rank's ``x``. Every rank passes the same shape
        and dtype. Works eagerly and under ``jit``.

        Args:
            x: array with a leading axis of length ``size`` (``tiled=False``:
                block ``r`` is ``x[r]``) or a multiple of ``size``
                (``tiled=True``: block ``r`` is the ``r``-th of ``size`` equal
                chunks).
            tiled: how the leading axis splits into blocks (see above).

        Returns:
            A new array of ``x``'s shape and dtype.

        Raises:
            TypeError: for a non-array ``x`` or a non-bool ``tiled``.
            ValueError: for a leading axis that does not fit the rules above.

        Example:
            With 4 ranks, each passing ``10 * rank + jnp.arange(4)``:

            >>> jc.alltoall(10 * jc.rank + jnp.arange(4))
            Array([ 1, 11, 21, 31], dtype=int32)   # on rank 1
        """
        handle = self._live()
        x = _as_array(x, "x")
        self._split_rows(x, _static_bool(tiled, "tiled"))
        return ops.alltoall(x, comm=handle)

    def allgatherv(self, x: ArrayLike, counts: Any) -> jax.Array:
        """Concatenate ``x`` from every rank along its leading axis, on every rank.

        Wraps ``MPI_Allgatherv``: ranks contribute different numbers of
        rows, given by ``counts``. The trailing dimensions and dtype must
        match on every rank. Works eagerly and under ``jit``.

        Args:
            x: array whose leading axis has ``counts[rank]`` rows (possibly 0).
            counts: static sequence of ``size`` non-negative ints, the rows
                each rank contributes, identical on every rank.

        Returns:
            A new array of shape ``(sum(counts), *x.shape[1:])``, the ranks'
            arrays in rank order.

        Raises:
            TypeError: for a non-array ``x`` or ``counts`` that is traced or
                not a sequence of ints.
            ValueError: for ``counts`` of the wrong length or with negative
                entries, or an ``x`` without ``counts[rank]`` rows.

        Example:
            With 3 ranks, rank ``r`` passing ``jnp.full(r, r)``:

            >>> jc.allgatherv(jnp.full(jc.rank, jc.rank), counts=[0, 1, 2])
            Array([1, 2, 2], dtype=int32)
        """
        handle = self._live()
        x = _as_array(x, "x")
        counts = self._counts(counts, "counts")
        self._own_rows(x, counts)
        return ops.allgatherv(x, counts=counts, comm=handle)

    def gatherv(self, x: ArrayLike, counts: Any, root: int = 0) -> jax.Array:
        """Concatenate ``x`` from every rank along its leading axis, on ``root``.

        Wraps ``MPI_Gatherv``. Like :meth:`allgatherv`, but only root gets the
        result; the other ranks get zeros of the same shape. Works eagerly
        and under ``jit``.

        Args:
            x: array whose leading axis has ``counts[rank]`` rows (possibly 0).
            counts: static sequence of ``size`` non-negative ints, the rows
                each rank contributes, identical on every rank.
            root: the rank that receives (a static int).

        Returns:
            A new array of shape ``(sum(counts), *x.shape[1:])``: the ranks'
            arrays in rank order on root, zeros elsewhere.

        Raises:
            TypeError: for a non-array ``x``, ``counts`` that is traced or not
                a sequence of ints, or a non-int or traced ``root``.
            ValueError: for bad ``counts`` (see :meth:`allgatherv`), an ``x``
                without ``counts[rank]`` rows, or a ``root`` out of range.

        Example:
            With 3 ranks, rank ``r`` passing ``jnp.full(r, r)``:

            >>> jc.gatherv(jnp.full(jc.rank, jc.rank), counts=[0, 1, 2], root=2)
            Array([1, 2, 2], dtype=int32)   # on rank 2; [0, 0, 0] elsewhere
        """
        handle = self._live()
        x = _as_array(x, "x")
        counts = self._counts(counts, "counts")
        self._own_rows(x, counts)
        return ops.gatherv(x, counts=counts, root=self._root(root), comm=handle)

    def scatterv(self, x: ArrayLike, counts: Any, root: int = 0) -> jax.Array:
        """Split root's ``x`` along its leading axis into pieces of ``counts`` rows.

        Wraps ``MPI_Scatterv``: rank ``r`` gets the ``r``-th piece, of
        ``counts[r]`` rows. Every rank passes an array of the same shape and
        dtype; only root's values are read. Works eagerly and under ``jit``.

        Args:
            x: array with ``sum(counts)`` rows.
            counts: static sequence of ``size`` non-negative ints, the rows
                each rank gets, identical on every rank.
            root: the rank whose ``x`` is scattered (a static int).

        Returns:
            A new array of shape ``(counts[rank], *x.shape[1:])``.

        Raises:
            TypeError: for a non-array ``x``, ``counts`` that is traced or not
                a sequence of ints, or a non-int or traced ``root``.
            ValueError: for bad ``counts`` (see :meth:`allgatherv`), an ``x``
                without ``sum(counts)`` rows, or a ``root`` out of range.

        Example:
            With 3 ranks:

            >>> jc.scatterv(jnp.arange(3), counts=[0, 1, 2], root=0)
            Array([1, 2], dtype=int32)   # on rank 2; [] on rank 0, [0] on rank 1
        """
        handle = self._live()
        x = _as_array(x, "x")
        counts = self._counts(counts, "counts")
        rows = _leading_axis(x, "to split among the ranks")
        if rows != sum(counts):
            raise ValueError(f"x has {rows} rows, but counts add up to {sum(counts)}")
        return ops.scatterv(
            x, counts=counts, root=self._root(root), rank=self._rank, comm=handle
        )

    def alltoallv(self, x: ArrayLike, counts: Any) -> jax.Array:
        """Exchange blocks of rows of different sizes between every pair of ranks.

        Wraps ``MPI_Alltoallv``. ``counts[i][j]`` is the number of rows rank
        ``i`` sends to rank ``j``: rank ``i``'s ``x`` holds its blocks for
        ranks 0, 1, ... one after another, and its result holds the blocks it
        receives from ranks 0, 1, ... one after another. The trailing
        dimensions and dtype must match on every rank. Works eagerly and
        under ``jit``.

        Args:
            x: array with ``sum(counts[rank])`` rows.
            counts: static ``size`` x ``size`` nested sequence of non-negative
                ints, identical on every rank.

        Returns:
            A new array of shape ``(sum(counts[i][rank] for i), *x.shape[1:])``.

        Raises:
            TypeError: for a non-array ``x`` or ``counts`` that is traced or
                not a nested sequence of ints.
            ValueError: for ``counts`` that is not ``size`` x ``size``, has
                negative entries, or does not give ``x``'s rows.

        Example:
            With 2 ranks, where rank 0 sends 1 row to itself and 2 to rank 1,
            and rank 1 sends 3 rows to rank 0 and none to itself:

            >>> counts = [[1, 2], [3, 0]]
            >>> jc.alltoallv(jnp.full(sum(counts[jc.rank]), jc.rank), counts)
            Array([0, 1, 1, 1], dtype=int32)   # on rank 0; [0, 0] on rank 1
        """
        handle = self._live()
        x = _as_array(x, "x")
        rows = self._per_rank(counts, "counts")
        matrix = [self._counts(row, f"counts[{i}]") for i, row in enumerate(rows)]
        send = matrix[self._rank]
        recv = tuple(row[self._rank] for row in matrix)
        own = _leading_axis(x, "of sum(counts[rank]) rows")
        if own != sum(send):
            raise ValueError(
                f"x has {own} rows on rank {self._rank}, but counts[{self._rank}] "
                f"adds up to {sum(send)}"
            )
        # Counts and displacements, in rows, of every rank's sends and receives.
        columns = [[row[j] for row in matrix] for j in range(self._size)]
        max_rows = max(
            max(max(block), sum(block) - block[-1]) for block in (*matrix, *columns)
        )
        return ops.alltoallv(
            x, sendcounts=send, recvcounts=recv, max_rows=max_rows, comm=handle
        )

    # Point to point ----------------------------------------------------------

    def send(self, x: ArrayLike, dest: int, tag: int = 0) -> None:
        """Send ``x`` to rank ``dest``.

        Wraps ``MPI_Send`` (blocking, standard mode). The send happens even
        though nothing is returned, also inside ``jit``.

        Args:
            x: array or scalar to send.
            dest: destination rank, or ``MPI.PROC_NULL`` to send nothing.
            tag: message tag, ``0 <= tag <= MPI.TAG_UB``.

        Raises:
            TypeError: for a non-array ``x`` or a non-int or traced ``dest``/``tag``.
            ValueError: for a ``dest`` or ``tag`` out of range.
        """
        handle = self._live()
        x = _as_array(x, "x")
        ops.send(x, dest=self._peer(dest, "dest"), tag=self._tag(tag, "tag"), comm=handle)

    def recv(
        self,
        x: Any,
        source: int = MPI.ANY_SOURCE,
        tag: int = MPI.ANY_TAG,
        status: MPI.Status | None = None,
    ) -> jax.Array:
        """Receive an array shaped like ``x`` from rank ``source``.

        Wraps ``MPI_Recv``. ``x`` only gives the shape and dtype (an array,
        tracer or ``jax.ShapeDtypeStruct``); it is not modified.

        Args:
            x: template for the received array's shape and dtype.
            source: sending rank, ``MPI.ANY_SOURCE`` or ``MPI.PROC_NULL``.
            tag: message tag or ``MPI.ANY_TAG``.
            status: an ``MPI.Status`` to fill with the message's source, tag
                and size. Eager calls fill it before returning; under ``jit``
                it is filled when the compiled call runs, so block on the
                result (or call ``jaxcomm.sync()``) before reading it.

        Returns:
            The received array.

        Raises:
            TypeError: for a bad template, a non-int or traced ``source``/``tag``
                or a ``status`` that is not an ``MPI.Status``.
            ValueError: for a ``source`` or ``tag`` out of range.
        """
        handle = self._live()
        shape, dtype = _shape_dtype(x, "x")
        result = ops.recv(
            shape=shape,
            dtype=dtype,
            source=self._peer(source, "source", any_source=True),
            tag=self._tag(tag, "tag", any_tag=True),
            status=_status_address(status),
            comm=handle,
        )
        return _wait_if_eager(result, status)

    def sendrecv(
        self,
        sendbuf: ArrayLike,
        recvbuf: Any,
        source: int,
        dest: int,
        sendtag: int = 0,
        recvtag: int = MPI.ANY_TAG,
        status: MPI.Status | None = None,
    ) -> jax.Array:
        """Send ``sendbuf`` to ``dest`` and receive from ``source`` in one call.

        Wraps ``MPI_Sendrecv``, which cannot deadlock on a ring or a pairwise
        exchange the way two blocking calls can. ``recvbuf`` only gives the
        shape and dtype, which must equal ``sendbuf``'s.

        Args:
            sendbuf: array or scalar to send.
            recvbuf: template for the received array (not modified).
            source: sending rank, ``MPI.ANY_SOURCE`` or ``MPI.PROC_NULL``.
            dest: destination rank or ``MPI.PROC_NULL``.
            sendtag: tag of the outgoing message.
            recvtag: tag to match, or ``MPI.ANY_TAG``.
            status: an ``MPI.Status`` to fill for the received message (see
                :meth:`recv`).

        Returns:
            The received array.

        Raises:
            TypeError: for bad arrays or non-int or traced ranks and tags.
            ValueError: if the buffers differ in shape or dtype, or a rank or
                tag is out of range.
        """
        handle = self._live()
        sendbuf = _as_array(sendbuf, "sendbuf")
        shape, dtype = _shape_dtype(recvbuf, "recvbuf")
        if (shape, dtype) != (sendbuf.shape, np.dtype(sendbuf.dtype)):
            raise ValueError(
                f"sendbuf ({sendbuf.dtype}{list(sendbuf.shape)}) and recvbuf "
                f"({dtype}{list(shape)}) must have the same shape and dtype"
            )
        result = ops.sendrecv(
            sendbuf,
            source=self._peer(source, "source", any_source=True),
            dest=self._peer(dest, "dest"),
            sendtag=self._tag(sendtag, "sendtag"),
            recvtag=self._tag(recvtag, "recvtag", any_tag=True),
            status=_status_address(status),
            comm=handle,
        )
        return _wait_if_eager(result, status)

    # Synchronisation ---------------------------------------------------------

    @staticmethod
    def sync() -> None:
        """Wait until every dispatched jaxcomm operation has finished (see ``jaxcomm.sync``)."""
        sync()
