"""``jax.vmap`` for jaxcomm primitives: the whole batch travels in one MPI call.

Under ``vmap`` a jaxcomm op with any batched operand moves all batch members,
as the loop it stands for would; its other operands are broadcast, so the
bytes on the wire depend only on the batch size. An op none of whose operands
is batched stays unbatched (one member's data), as JAX expects of values that
do not depend on the batch (``jacfwd`` relies on it). So ranks that exchange
data must batch it alike: a root broadcasting batched data needs batched
placeholders on the other ranks (``x * 0``, not ``jnp.zeros(x.shape)``), and a
``recv`` of a batched message needs a batched template (pass ``x``, not a
``jax.ShapeDtypeStruct``); otherwise the message sizes differ and MPI reports
truncation.

For the same reason each rule puts the batch axis at a fixed position rather
than wherever the caller's computation happened to leave it:

- ops that treat their buffer as flat elements (reductions, bcast, p2p) put it
  first: the message is the batch members one after another;
- ops whose leading axis means ranks' blocks or rows put it second, so that
  the leading axis keeps that meaning, every row holds the whole batch, and
  the row counts in the params stay right.

Moving the axis costs a transpose only where it was elsewhere; the defaults
(``in_axes=0``, most of JAX's own rules) leave it first.
"""

import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

from .. import _compat


def batch_whole(prim, layout):
    """Register ``prim``'s batching rule.

    It is registered as a "fancy" rule, which JAX calls also when no operand
    is batched (the op then runs once, unbatched).

    Args:
        prim: the primitive.
        layout: maps the primitive's params to the pair (axis the batch takes
            in the operands, axis it has in every output).
    """

    def rule(axis_data, args, dims, **params):
        if all(dim is None for dim in dims):
            outs = prim.bind(*args, **params)
            return outs, [None] * len(outs)
        in_axis, out_axis = layout(**params)
        args = [placed(x, dim, in_axis, axis_data.size) for x, dim in zip(args, dims)]
        outs = prim.bind(*args, **params)
        return outs, [out_axis] * len(outs)

    _compat.fancy_primitive_batchers[prim] = rule


def placed(x, dim, axis, size):
    """``x`` with its batch axis, of length ``size``, at ``axis``."""
    if dim is None:
        shape = list(x.shape)
        shape.insert(axis, size)
        return jnp.broadcast_to(jnp.expand_dims(x, axis), shape)
    return x if dim == axis else jnp.moveaxis(x, dim, axis)


def flat(**_):
    """Buffers read as flat elements: batch members one after another."""
    return 0, 0


def behind_rows(**_):
    """The leading axis holds rows or ranks' blocks, in and out."""
    return 1, 1


def stacked(*, tiled, **_):
    """allgather, gather: a new leading axis of ranks' blocks, or more rows (``tiled``)."""
    return (1 if tiled else 0), 1


def split(*, tiled, **_):
    """scatter, reduce_scatter: the leading axis of blocks goes, or holds rows (``tiled``)."""
    return 1, (1 if tiled else 0)


# Buffers of derivative rules -----------------------------------------------------
#
# A transpose rule sends cotangents and receives into templates it makes, and
# whether a cotangent depends on the batch follows each rank's own data flow.
# Under vmap, ranks would then disagree about message sizes. Every buffer such
# a rule communicates goes through batched_alike, an identity whose batching
# rule always batches: under vmap, rules' messages always hold the whole batch,
# whether the rule runs inside the vmap or in a loop body vmap batches later.

batched_alike_p = Primitive("jaxcomm_batched_alike")
batched_alike_p.def_impl(lambda x: x)
batched_alike_p.def_abstract_eval(lambda aval: aval)
mlir.register_lowering(batched_alike_p, lambda ctx, x: [x])
ad.deflinear2(batched_alike_p, lambda ct, x: [batched_alike(ct)])


def batched_alike(x):
    """``x``, batched along every ``vmap`` it is inside (broadcast where it was not)."""
    return batched_alike_p.bind(x)


def _always_batched(axis_data, args, dims):
    (x,), (dim,) = args, dims
    x = placed(x, dim, 0, axis_data.size)
    return batched_alike(x), 0


_compat.fancy_primitive_batchers[batched_alike_p] = _always_batched
