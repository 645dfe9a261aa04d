"""Derivative rules that bind another family's collectives.

The family modules (``bcast.py``, ``gather.py``, ``reduction.py``) import only
the shared machinery, never each other. Where an op's derivative is another
family's collective (a reduce transposes to a broadcast, a broadcast bound by
a transpose to a reduce), the rule is registered here, after the families it
binds; ``jaxcomm.ops`` imports this module, so the rules are in place before
any op runs.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax.interpreters import ad

from ._adjoint import replicated_adjoint
from ._base import (
    SUM,
    def_linear,
    def_transpose,
    derivative_comm,
    not_differentiable,
    op_name,
    rank_of,
    size_of,
)
from .bcast import bcast, bcast_p
from .gather import allgather, allgather_p, allgatherv_p, alltoall, rank_rows
from .reduction import allreduce, allreduce_p, reduce, reduce_p, reduce_scatter, reduce_scatter_p

# Replicated collectives: a user's result is one value and transposes
# locally (_adjoint.py); one bound by a transpose (replicated=False) maps
# per-rank values to per-rank values and transposes exactly, to a reduction.


def _bcast_transpose(ct, aval, *, root, handle, replicated):
    if replicated:
        return replicated_adjoint(ct, kind="bcast", root=root, handle=handle)
    return reduce(ct, op=SUM, root=root, handle=handle)


def _allgather_transpose(ct, aval, *, size, tiled, handle, replicated):
    if replicated:
        return replicated_adjoint(ct, kind="allgather", size=size, tiled=tiled, handle=handle)
    return reduce_scatter(ct, op=SUM, size=size, tiled=tiled, handle=handle)


def _allgatherv_transpose(ct, aval, *, counts, handle, replicated):
    if replicated:
        return replicated_adjoint(ct, kind="allgatherv", counts=counts, handle=handle)
    total = allreduce(ct, op=SUM, handle=handle, replicated=False)
    return rank_rows(total, rank_of(handle), counts=counts)


# Reductions whose outputs differ per rank transpose exactly, to the
# collectives above bound per rank.


def _reduce_transpose(ct, aval, *, op, root, handle):
    return bcast(ct, root=root, handle=handle, replicated=False)


def _reduce_scatter_transpose(ct, aval, *, op, size, tiled, handle):
    return allgather(ct, size=size, tiled=tiled, handle=handle, replicated=False)


def contribution(x, t, op, handle, what):
    """This rank's term of the tangent of the reduction of ``x`` with ``op``.

    The reduction's tangent is the SUM over ranks of these terms. MAX and MIN
    split the tangent evenly among the ranks (and elements) that hold the
    extremum. PROD multiplies by the product of the other ranks' values,
    gathered rather than divided out so that zeros are handled exactly.

    Args:
        x: this rank's operand of the reduction.
        t: its tangent.
        op: the reduction code.
        handle: the communicator the terms' collectives run on (the
            derivative communicator).
        what: the op, for the error where ``op`` has no derivative.

    Raises:
        NotImplementedError: ``op`` is not SUM, MAX, MIN or PROD.
    """
    name = op_name(op)
    if name == "SUM":
        return t
    if name in ("MAX", "MIN"):
        # Where the extremum sits has no derivative; say so rather than
        # differentiate the comparison.
        x = jax.lax.stop_gradient(x)
        hit = x == allreduce(x, op=op, handle=handle)
        count = allreduce(hit.astype(t.dtype), op=SUM, handle=handle)
        # count >= 1 wherever hit holds; the maximum only guards NaN inputs.
        return jnp.where(hit, t / jnp.maximum(count, 1), jnp.zeros_like(t))
    if name == "PROD":
        # Every rank's x, by an alltoall of copies: unlike allgather (whose
        # replicated cotangent would be wrong here, since each rank uses the
        # rows differently) it transposes exactly, so higher orders are right.
        size = size_of(handle)
        rows = alltoall(jnp.broadcast_to(x, (size, *x.shape)), handle=handle)
        others = jnp.prod(rows.at[rank_of(handle)].set(1), axis=0)
        return others * t
    raise not_differentiable(f"{what} with MPI.{name}")


def _reduction_jvp(prim, primals, tangents, *, op, handle, **params):
    (x,), (t,) = primals, tangents
    t = ad.instantiate_zeros(t)
    y = prim.bind(x, op=op, handle=handle, **params)
    derivative = derivative_comm(handle)
    term = contribution(x, t, op, derivative, prim.name)
    return y, prim.bind(term, op=SUM, handle=derivative, **params)


def_linear(bcast_p, _bcast_transpose)
def_linear(allgather_p, _allgather_transpose)
def_linear(allgatherv_p, _allgatherv_transpose)
def_transpose(reduce_p, _reduce_transpose)
def_transpose(reduce_scatter_p, _reduce_scatter_transpose)
for _prim in (allreduce_p, reduce_p):
    ad.primitive_jvps[_prim] = partial(_reduction_jvp, _prim)
