"""What ``JaxComm``'s methods make of their arguments, and of the ops' results.

Each function checks one kind of argument and returns it as the plain value
a primitive takes (an array, an int, a reduction code), raising the
``TypeError`` or ``ValueError`` that names the argument. Checks that depend
on the communicator take its size, rank or tag bound as arguments.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Set
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from . import _compat, ops
from .ops._base import ALLOWED_DTYPES, REDUCTION_OPS, SUPPORTED_DTYPES
from .ops._tree import tree_call

ArrayLike = Any  # a JAX or NumPy array, or a Python scalar

_LOGICAL = ("LAND", "LOR", "LXOR")

# Arrays ------------------------------------------------------------------------


def check_dtype(dtype, name: str) -> None:
    if np.dtype(dtype) not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {dtype}, which jaxcomm cannot send")


@_compat.eager_outside_mesh
def as_array(x: ArrayLike, name: str) -> jax.Array:
    if isinstance(x, (MPI.Status, str, bytes)) or x is None:
        raise TypeError(f"{name} must be an array or a scalar, got {type(x).__name__}")
    if isinstance(x, (np.ndarray, np.generic)):
        # Before JAX converts it, which would reject a string or object dtype
        # without naming the argument.
        check_dtype(x.dtype, name)
    try:
        array = x if isinstance(x, jax.Array) else jnp.asarray(x)
    except TypeError as err:
        raise TypeError(f"{name} must be an array or a scalar, got {type(x).__name__}") from err
    check_dtype(array.dtype, name)
    return array


@_compat.eager_outside_mesh
def held(x: ArrayLike, name: str) -> jax.Array:
    """``x`` as an array that MPI may read after the call returns.

    A JAX array made from a NumPy array may share its memory, which the
    caller can still write: a nonblocking op sends from a copy of it.
    """
    array = as_array(x, name)
    return jnp.array(array, copy=True) if isinstance(x, np.ndarray) else array


def shape_dtype(x: Any, name: str) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of an array, tracer, ShapeDtypeStruct or scalar."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        shape = tuple(int(d) for d in x.shape)
        dtype = np.dtype(jax.dtypes.canonicalize_dtype(x.dtype))
    else:
        array = as_array(x, name)
        shape, dtype = array.shape, np.dtype(array.dtype)
    check_dtype(dtype, name)
    return shape, dtype


@_compat.eager_outside_mesh
def template(x: Any, name: str) -> jax.Array:
    """An array shaped like ``x`` (zeros for a ``jax.ShapeDtypeStruct``)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        check_dtype(x.dtype, name)
        return jnp.zeros(x.shape, x.dtype)
    return as_array(x, name)


def pytree_leaves(tree: Any, name: str) -> tuple[list[jax.Array], Any]:
    """The pytree's leaves as arrays, and its structure."""
    if tree is None:
        as_array(tree, name)  # raises: None is an empty pytree, not an array
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        raise ValueError(f"{name} is a pytree with no arrays")
    return [as_array(leaf, name) for leaf in leaves], treedef


def leading_axis(x: jax.Array, why: str) -> int:
    if x.ndim == 0:
        raise ValueError(f"x must have a leading axis {why}, got a 0-d array")
    return x.shape[0]


def stackable_leaves(x: Any, tiled: Any) -> tuple[list[jax.Array], Any]:
    """Leaves for allgather/gather: with ``tiled``, each needs a leading axis."""
    leaves, treedef = pytree_leaves(x, "x")
    if static_bool(tiled, "tiled"):
        for leaf in leaves:
            leading_axis(leaf, "to concatenate along with tiled=True")
    return leaves, treedef


def check_split_rows(x: jax.Array, tiled: bool, size: int, *, op: str | None = None) -> None:
    """Check that ``x``'s leading axis splits into ``size`` blocks.

    With ``tiled=False`` it needs one row per rank, with ``tiled=True`` a
    multiple of ``size`` rows. ``op`` words the errors as that op's own,
    naming the communicator size and ``x``'s shape (reduce_scatter's);
    otherwise they name the rows.
    """
    fits = x.ndim > 0 and (x.shape[0] % size == 0 if tiled else x.shape[0] == size)
    if fits:
        return
    if op is not None:
        if tiled:
            raise ValueError(
                f"x must have a leading axis that is a multiple of the communicator size "
                f"{size} for a tiled {op}, got shape {x.shape}"
            )
        raise ValueError(
            f"x must have a leading axis of length {size} (the communicator size) "
            f"for {op}, got shape {x.shape}; pass tiled=True to split a longer axis"
        )
    rows = leading_axis(x, "to split among the ranks")
    if not tiled:
        raise ValueError(
            f"x has leading axis {rows}; with tiled=False it needs one entry per rank ({size})"
        )
    raise ValueError(f"x has leading axis {rows}, which does not split into {size} equal chunks")


def check_own_rows(x: jax.Array, counts: tuple[int, ...], rank: int) -> None:
    rows = leading_axis(x, "of counts[rank] rows")
    if rows != counts[rank]:
        raise ValueError(f"x has {rows} rows on rank {rank}, but counts[{rank}] is {counts[rank]}")


# Static values -------------------------------------------------------------------


def static_int(value: Any, name: str) -> int:
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


def static_bool(value: Any, name: str) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} must be a static bool, but got a traced value; "
            "compute it outside jax.jit or mark it static"
        )
    raise TypeError(f"{name} must be a static bool, got {type(value).__name__}")


def sequence(value: Any, name: str) -> list[Any]:
    """The entries of a static sequence (a list, tuple or array, not a str, set or dict)."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{name} must be a static sequence, but got a traced value; "
            "pass a Python list or tuple known when the function is traced"
        )
    # A str iterates into characters, and sets and dicts have no order that
    # every rank would agree on.
    if isinstance(value, (str, bytes, Set, Mapping)):
        raise TypeError(f"{name} must be a sequence, got {type(value).__name__}")
    if isinstance(value, jax.Array):
        # A concrete array closed over by a jitted function is a constant, but
        # iterating it there stages each indexing out and gives tracers: read
        # its values on the host instead.
        value = np.asarray(value)
    try:
        return list(value)
    except TypeError:
        raise TypeError(f"{name} must be a sequence, got {type(value).__name__}") from None


def mesh_axis_name(
    axis_name: Any, axis_index_groups: Any, mesh_axes: tuple[str, ...] | None, op: str
) -> None:
    """Check ``jax.lax``'s ``axis_name`` and ``axis_index_groups`` against a communicator.

    ``axis_name`` (a name or a tuple of names) must be None, or the axes of a
    ``JaxComm.for_mesh`` communicator (``mesh_axes``) in the order they were
    given to it, which is the order its ranks are numbered in.
    """
    if axis_index_groups is not None:
        raise NotImplementedError(
            f"{op}: axis_index_groups is not supported; split the communicator instead "
            "(JaxComm.split, or JaxComm.for_mesh over a mesh axis whose lines are the groups)"
        )
    if axis_name is None:
        return
    names = (axis_name,) if isinstance(axis_name, str) else axis_name
    if not isinstance(names, (tuple, list)) or not all(isinstance(a, str) for a in names):
        raise TypeError(
            f"{op}: axis_name must be a mesh axis name or a tuple of them, got {axis_name!r}"
        )
    names = tuple(names)
    if mesh_axes is None:
        raise ValueError(
            f"{op}: axis_name={axis_name!r} names mesh axes, but this JaxComm was not made by "
            "JaxComm.for_mesh: its ranks are those of its MPI communicator, along no mesh axis. "
            f"Call it on JaxComm.for_mesh(mesh, {axis_name!r}), or leave axis_name unset"
        )
    if names == mesh_axes:
        return
    if sorted(names) == sorted(mesh_axes):
        raise ValueError(
            f"{op}: axis_name={axis_name!r} numbers the positions along {names} in that order, "
            f"but this JaxComm's ranks are numbered along {mesh_axes}; "
            f"make one with JaxComm.for_mesh(mesh, {names!r})"
        )
    raise ValueError(
        f"{op}: axis_name={axis_name!r}, but this JaxComm communicates along the mesh axes "
        f"{mesh_axes}; make one with JaxComm.for_mesh(mesh, {names!r}) for those axes"
    )


def static_rank(
    value: Any, name: str, size: int, *, proc_null: bool = False, any_source: bool = False
) -> int:
    """A rank of a ``size``-process communicator, or the wildcards allowed."""
    rank = static_int(value, name)
    if (proc_null and rank == MPI.PROC_NULL) or (any_source and rank == MPI.ANY_SOURCE):
        return rank
    if not 0 <= rank < size:
        raise ValueError(f"{name}={rank} is not a rank of this {size}-process communicator")
    return rank


def static_tag(value: Any, name: str, tag_ub: int, *, any_tag: bool = False) -> int:
    tag = static_int(value, name)
    if any_tag and tag == MPI.ANY_TAG:
        return tag
    if not 0 <= tag <= tag_ub:
        raise ValueError(f"{name}={tag} is outside the valid tag range 0..{tag_ub}")
    return tag


def per_rank(value: Any, name: str, size: int) -> list[Any]:
    """The entries of a static sequence with one entry per rank."""
    items = sequence(value, name)
    if len(items) != size:
        raise ValueError(f"{name} has {len(items)} entries; it needs one per rank ({size})")
    return items


def static_counts(value: Any, name: str, size: int) -> tuple[int, ...]:
    """One static, non-negative row count per rank."""
    items = per_rank(value, name, size)
    counts = tuple(static_int(c, f"{name}[{i}]") for i, c in enumerate(items))
    for i, count in enumerate(counts):
        if count < 0:
            raise ValueError(f"{name}[{i}]={count} is negative")
    return counts


def rows_arrays(operand: ArrayLike, output: ArrayLike) -> tuple[jax.Array, jax.Array]:
    """Two arrays of rows that can exchange them: leading axes, same row shape and dtype."""
    operand, output = as_array(operand, "operand"), as_array(output, "output")
    for name, x in (("operand", operand), ("output", output)):
        if x.ndim == 0:
            raise ValueError(f"{name} must have a leading axis of rows, got a 0-d array")
    if operand.shape[1:] != output.shape[1:]:
        raise ValueError(
            f"operand rows have shape {operand.shape[1:]}, output rows {output.shape[1:]}; "
            "they must match"
        )
    if operand.dtype != output.dtype:
        raise TypeError(f"operand is {operand.dtype}, output {output.dtype}; they must match")
    return operand, output


def index_arrays(
    values: dict[str, Any], size: int | dict[str, int], per: str = "rank"
) -> tuple[jax.Array, ...]:
    """Arrays of one integer per rank, static or traced, in one dtype: int64 if any is, else int32.

    ``size`` may give each array's length by name instead, one integer per ``per``.
    """
    arrays = []
    for name, value in values.items():
        length = size[name] if isinstance(size, dict) else size
        try:
            if isinstance(value, (list, tuple)) and not value:
                # An empty list has no integers for the dtype to come from.
                value = np.zeros(0, np.int32)
            array = value if isinstance(value, jax.Array) else jnp.asarray(value)
        except TypeError:
            raise TypeError(f"{name} must be an integer array, got {value!r}") from None
        if not jnp.issubdtype(array.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array, got {array.dtype}")
        if array.shape != (length,):
            raise ValueError(
                f"{name} has shape {array.shape}; it needs one entry per {per}, shape ({length},)"
            )
        arrays.append(array)
    wide = any(a.dtype == np.int64 for a in arrays)
    dtype = np.int64 if wide else np.int32
    return tuple(a.astype(dtype) for a in arrays)


def is_matrix(value: Any) -> bool:
    """Whether ``value`` is a static nested sequence (a counts matrix), not one count per rank."""
    if isinstance(value, (jax.Array, np.ndarray)):
        return np.ndim(value) == 2
    try:
        first = next(iter(value))
    except (TypeError, StopIteration):
        return False
    return isinstance(first, (list, tuple, np.ndarray))


# Reductions ----------------------------------------------------------------------


def _reduction_code(op: Any, dtype: np.dtype) -> int:
    if not isinstance(op, MPI.Op):
        raise TypeError(f"op must be a predefined mpi4py MPI.Op such as MPI.SUM, got {op!r}")
    for code, (name, predefined) in enumerate(REDUCTION_OPS):
        if op == predefined:
            if dtype not in ALLOWED_DTYPES[name]:
                raise TypeError(f"op MPI.{name} is not defined for dtype {dtype}")
            return code
    predefined = ", ".join(f"MPI.{name}" for name, _ in REDUCTION_OPS)
    if op in (MPI.MAXLOC, MPI.MINLOC):
        # MPI defines them on (value, index) pair datatypes only (MPI.FLOAT_INT...).
        which = "MAXLOC" if op == MPI.MAXLOC else "MINLOC"
        extreme = "MAX" if which == "MAXLOC" else "MIN"
        raise ValueError(
            f"op MPI.{which} is not supported: MPI defines it only for (value, index) pair "
            "datatypes such as MPI.FLOAT_INT, which JAX arrays have no dtype for. Compute it "
            f"with two reductions: m = allreduce(x, op=MPI.{extreme}), then "
            "allreduce(where(x == m, index, big), op=MPI.MIN) for the smallest index holding "
            f"m. Supported ops: {predefined}"
        )
    if op in (MPI.REPLACE, MPI.NO_OP):
        raise ValueError(
            f"op {op!r} is for one-sided accumulation (MPI_Accumulate), not for reductions. "
            f"Supported ops: {predefined}"
        )
    raise ValueError(
        f"op {op!r} is not supported: a user-defined MPI.Op (MPI.Op.Create) calls a Python "
        "function on raw buffers inside the MPI call, which JAX can neither trace, "
        "differentiate nor batch, and jaxcomm's kernels make MPI calls on XLA's threads, "
        "where calling back into Python is not safe. Reduce with "
        f"a predefined op ({predefined}), or gather the values (allgather) and combine "
        "them with JAX code."
    )


def reduction_operand(x: ArrayLike, op: Any) -> tuple[jax.Array, int]:
    """``x`` as an array and ``op`` as a reduction code, checked against its dtype."""
    x = as_array(x, "x")
    code = _reduction_code(op, np.dtype(x.dtype))
    if REDUCTION_OPS[code][0] in _LOGICAL and x.dtype != bool:
        # MPI leaves a single process's integers as they are; 0/1 inputs
        # give the same 0/1 answer on any number of ranks.
        x = (x != 0).astype(x.dtype)
    return x, code


def reduction_leaves(x: Any, op: Any) -> tuple[list[jax.Array], Any, int]:
    """A pytree's leaves as reduction operands, its structure, and ``op``'s code."""
    leaves, treedef = pytree_leaves(x, "x")
    operands = [reduction_operand(leaf, op) for leaf in leaves]
    return [leaf for leaf, _ in operands], treedef, operands[0][1]


# MPI objects ---------------------------------------------------------------------


def intracomm(comm: Any) -> MPI.Intracomm:
    """``comm``, or ``MPI.COMM_WORLD`` for None, checked to be a usable ``Intracomm``."""
    if comm is None:
        return MPI.COMM_WORLD
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py Intracomm, got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError("comm must be a live communicator, got MPI.COMM_NULL (freed or null)")
    return comm


def check_status(status: MPI.Status | None) -> None:
    if status is not None and not isinstance(status, MPI.Status):
        raise TypeError(f"status must be an MPI.Status or None, got {type(status).__name__}")


# Results -------------------------------------------------------------------------


def call_on_tree(leaves, treedef, op_name: str, tiled: bool | None = None, **params):
    """Run ``jaxcomm.ops.<op_name>`` on a pytree's leaves.

    One array goes straight to the op. A pytree's leaves are packed into one
    buffer per dtype; ops with a ``tiled`` parameter then stack them
    (``tiled=False``), and ``tiled`` decides whether each leaf's stacked axis is
    merged into its first axis.
    """
    if jax.tree_util.treedef_is_leaf(treedef):
        extra = {} if tiled is None else {"tiled": tiled}
        return getattr(ops, op_name)(leaves[0], **params, **extra)
    if tiled is not None:
        params["tiled"] = False
    out = tree_call(tuple(leaves), op_name, tuple(sorted(params.items())), bool(tiled))
    return jax.tree_util.tree_unflatten(treedef, out)


def received(
    result: jax.Array,
    envelope: jax.Array,
    status: MPI.Status | None,
    return_status: bool,
    handle: int,
) -> Any:
    """What ``recv``/``sendrecv`` return, after filling ``status`` from the envelope.

    In a traced call the compiled code fills ``status`` when it runs, in
    program order with the receive (``ops.write_status``).
    """
    if status is not None:
        if isinstance(result, jax.core.Tracer):
            ops.write_status(envelope, status, itemsize=result.dtype.itemsize, handle=handle)
        else:
            source, tag, count = np.asarray(envelope).tolist()
            status.Set_source(source)
            status.Set_tag(tag)
            status.Set_error(MPI.SUCCESS)
            status.Set_elements(MPI.BYTE, count * result.dtype.itemsize)
    return (result, envelope) if return_status else result
