"""``jax.vmap`` for jaxcomm primitives: the whole batch travels in one MPI call.

A batched operand is one buffer holding every batch member, so the rule binds
the primitive once on it. Where the batch axis sits decides the bytes on the
wire, and the ranks at both ends of a message must agree on them even when
they ran different code (a send and its recv, a root and the others), so each
rule puts the batch axis at a fixed position rather than wherever the caller's
computation happened to leave it:

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
    """Register ``prim``'s batching rule, for a primitive with one operand.

    Args:
        prim: the primitive.
        layout: maps the primitive's params to the pair (axis the batch takes
            in the operand, axis it has in every output).
    """

    def rule(args, dims, **params):
        (x,), (dim,) = args, dims
        in_axis, out_axis = layout(**params)
        if dim != in_axis:
            x = jnp.moveaxis(x, dim, in_axis)
        outs = prim.bind(x, **params)
        return outs, [out_axis] * len(outs)

    batching.primitive_batchers[prim] = rule


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
