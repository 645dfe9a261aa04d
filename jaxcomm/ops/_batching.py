"""``jax.vmap`` for jaxcomm primitives: the whole batch travels in one MPI call.

Under ``vmap`` every jaxcomm op moves all batch members, as the loop it
stands for would, also where an operand is the same for all of them (it is
broadcast): then the bytes on the wire depend only on the batch size, never
on which operands a rank's code happens to batch. Ranks must agree on them
even where they run different code: a send and its recv, a root that
broadcasts its batched data and other ranks that pass zeros of one member's
shape, a ``recv`` whose template is a ``jax.ShapeDtypeStruct``.

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
from jax.interpreters import batching


def batch_whole(prim, layout):
    """Register ``prim``'s batching rule.

    It is registered as a "fancy" rule because JAX calls those also when no
    operand is batched; plain rules would leave such an op unbatched.

    Args:
        prim: the primitive.
        layout: maps the primitive's params to the pair (axis the batch takes
            in the operands, axis it has in every output).
    """

    def rule(axis_data, args, dims, **params):
        in_axis, out_axis = layout(**params)
        args = [_placed(x, dim, in_axis, axis_data.size) for x, dim in zip(args, dims)]
        outs = prim.bind(*args, **params)
        return outs, [out_axis] * len(outs)

    batching.fancy_primitive_batchers[prim] = rule


def _placed(x, dim, axis, size):
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
