"""Cotangents of replicated values: the local halves of the replicated-value convention.

A collective whose result is replicated (``allreduce``, ``bcast``,
``allgather``, ``allgatherv``) maps per-rank values to one value held by every
rank. Its transpose maps that value's cotangent back to per-rank cotangents
without communicating: the identity, "root keeps it", "own slice". Those local
maps are bound as ``replicated_adjoint_p`` rather than computed inline, so that
transposing them again gives the collective back (transposition is an
involution, and reverse-over-reverse agrees with forward-over-reverse).

Each op module registers its kind with :func:`register`: the local map and the
collective it transposes to.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from .. import _compat
from ._base import def_linear, rank_of, typed_outputs

replicated_adjoint_p = Primitive("replicated_adjoint")
replicated_adjoint_p.multiple_results = True

# kind -> (local(ct, rank, **params), collective(ct, aval, **params)).
_KINDS = {}


def register(kind, local, collective):
    """Register a replicated collective's adjoint.

    Args:
        kind: the collective's name, the ``kind`` parameter of the primitive.
        local: ``local(ct, rank, **params)`` maps the replicated cotangent to
            this rank's cotangent, operating on the leading axis only.
        collective: ``collective(ct, aval, **params)`` is the transpose of
            ``local``: it binds the replicated collective.
    """
    _KINDS[kind] = (local, collective)


def replicated_adjoint(ct, *, kind, handle, **params):
    """This rank's cotangent of its input to the replicated collective ``kind``."""
    (y,) = replicated_adjoint_p.bind(ct, kind=kind, handle=handle, **params)
    return y


def _local(ct, *, kind, handle, **params):
    local, _ = _KINDS[kind]
    return [local(ct, rank_of(handle), **params)]


def _abstract_eval(aval, **params):
    (out,) = jax.eval_shape(partial(_local, **params), jax.ShapeDtypeStruct(aval.shape, aval.dtype))
    # Each rank's part of the cotangent: it varies over the communicator's axes.
    out = jax.core.ShapedArray(out.shape, out.dtype)
    return typed_outputs([out], [aval], params["handle"], replicated=False)


def _batch(args, dims, **params):
    # The local maps touch only the leading axis: the batch goes last.
    (ct,), (dim,) = args, dims
    ct = jnp.moveaxis(ct, dim, -1)
    (out,) = _local(ct, **params)
    return [out], [out.ndim - 1]


def _collective(ct, aval, *, kind, **params):
    _, collective = _KINDS[kind]
    return collective(ct, aval, **params)


replicated_adjoint_p.def_impl(_local)
replicated_adjoint_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(replicated_adjoint_p, mlir.lower_fun(_local, multiple_results=True))
batching.primitive_batchers[replicated_adjoint_p] = _batch
def_linear(replicated_adjoint_p, _collective)
# It makes no MPI call, but its transpose does: every rank must differentiate
# it alike, so JAX must not skip it where its tangent is a symbolic zero
# (a rank whose replicated value does not depend on the input).
_compat.communicating_primitives.add(replicated_adjoint_p)
