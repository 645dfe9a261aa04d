"""Reductions: allreduce, reduce, scan, exscan, reduce_scatter."""

from functools import partial

import jax
from jax.interpreters import ad

from ._adjoint import register, replicated_adjoint
from ._base import (
    SUM,
    comm_primitive,
    def_transpose,
    linear_jvp,
    not_differentiable,
    op_name,
    replicated_operand,
    same_as_input,
)
from ._batching import batch_whole, flat, split


def _reduce_scatter_abstract_eval(aval, *, size, tiled, **_):
    shape = (aval.shape[0] // size, *aval.shape[1:]) if tiled else aval.shape[1:]
    return [jax.core.ShapedArray(shape, aval.dtype)]


# MPI_Allreduce, MPI_Scan, MPI_Exscan and the root's MPI_Reduce have in-place
# forms; the kernels use them where the output has the input's buffer.
allreduce_p = comm_primitive(
    "allreduce", same_as_input, "jaxcomm_allreduce", ("handle", "op"), in_place=True
)
reduce_p = comm_primitive(
    "reduce", same_as_input, "jaxcomm_reduce", ("handle", "op", "root"), in_place=True
)
scan_p = comm_primitive("scan", same_as_input, "jaxcomm_scan", ("handle", "op"), in_place=True)
exscan_p = comm_primitive(
    "exscan", same_as_input, "jaxcomm_exscan", ("handle", "op"), in_place=True
)
# The kernel reads the block size off its output; size and tiled only shape it.
reduce_scatter_p = comm_primitive(
    "reduce_scatter", _reduce_scatter_abstract_eval, "jaxcomm_reduce_scatter", ("handle", "op")
)


def allreduce(x, *, op, handle, replicated=True):
    """Bind ``allreduce_p``: ``MPI_Allreduce`` with reduction code ``op``.

    ``replicated`` picks the transpose of a SUM: the result is one replicated
    value (the user's allreduce), or per-rank values (an allreduce bound by a
    transpose), which transpose exactly, to another such allreduce.
    """
    x, replicated = replicated_operand(x, handle, replicated)
    (y,) = allreduce_p.bind(x, op=op, handle=handle, replicated=replicated)
    return y


def reduce(x, *, op, root, handle):
    """Bind ``reduce_p``: ``MPI_Reduce`` onto ``root``; other ranks get zeros."""
    (y,) = reduce_p.bind(x, op=op, root=root, handle=handle)
    return y


def scan(x, *, op, handle):
    """Bind ``scan_p``: ``MPI_Scan``, the inclusive prefix reduction."""
    (y,) = scan_p.bind(x, op=op, handle=handle)
    return y


def exscan(x, *, op, handle):
    """Bind ``exscan_p``: ``MPI_Exscan``, the exclusive prefix reduction (zeros on rank 0)."""
    (y,) = exscan_p.bind(x, op=op, handle=handle)
    return y


def reduce_scatter(x, *, op, size, tiled, handle):
    """Bind ``reduce_scatter_p``: ``MPI_Reduce_scatter_block`` over ``size`` blocks of ``x``."""
    (y,) = reduce_scatter_p.bind(x, op=op, size=size, tiled=tiled, handle=handle)
    return y


# vmap -------------------------------------------------------------------------

for _prim in (allreduce_p, reduce_p, scan_p, exscan_p):
    batch_whole(_prim, flat)
batch_whole(reduce_scatter_p, split)


# Differentiation -------------------------------------------------------------
#
# SUM reductions are linear. Under the replicated-value convention a user's
# allreduce result is one value, so its transpose is the identity (bound as
# replicated_adjoint_p, whose transpose is the allreduce again); reduce, scan,
# exscan and reduce_scatter outputs differ per rank and transpose exactly, and
# so do the collectives their transposes bind (replicated=False). MAX, MIN and
# PROD allreduce/reduce are differentiated through a SUM of per-rank
# contributions, so they transpose too. Rules that bind other families'
# collectives (the transposes of reduce and reduce_scatter, the JVPs of
# allreduce and reduce) are registered in _crossing.py.


def _sum_only_jvp(prim, primals, tangents, *, op, **params):
    if op_name(op) != "SUM":
        raise not_differentiable(f"{prim.name} with MPI.{op_name(op)}")
    return linear_jvp(prim, primals, tangents, op=op, **params)


def _total(ct, handle):
    """The SUM of every rank's cotangent, as per-rank values (it transposes to itself)."""
    return allreduce(ct, op=SUM, handle=handle, replicated=False)


def _allreduce_transpose(ct, aval, *, op, handle, replicated):
    if replicated:
        return replicated_adjoint(ct, kind="allreduce", handle=handle)
    return _total(ct, handle)


def _scan_transpose(ct, aval, *, op, handle):
    # Rank r's input reaches outputs r, r + 1, ...: the total minus the
    # exclusive prefix (zeros on rank 0) of the cotangents.
    return _total(ct, handle) - exscan(ct, op=SUM, handle=handle)


def _exscan_transpose(ct, aval, *, op, handle):
    # Rank r's input reaches outputs r + 1, ...: the total minus the
    # inclusive prefix of the cotangents.
    return _total(ct, handle) - scan(ct, op=SUM, handle=handle)


register(
    "allreduce",
    lambda ct, rank: ct,
    lambda ct, aval, *, handle: allreduce(ct, op=SUM, handle=handle),
)
def_transpose(allreduce_p, _allreduce_transpose)
def_transpose(scan_p, _scan_transpose)
def_transpose(exscan_p, _exscan_transpose)
for _prim in (scan_p, exscan_p, reduce_scatter_p):
    ad.primitive_jvps[_prim] = partial(_sum_only_jvp, _prim)
