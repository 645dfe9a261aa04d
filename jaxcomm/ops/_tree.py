"""Pytrees through one MPI call per dtype.

A pytree's leaves are grouped by dtype; each group is flattened and packed
into one buffer inside a compiled program, travels in one MPI call, and is
cut back into leaves. Allreducing a gradient pytree of 100 leaves therefore
costs one MPI call per distinct dtype, not 100.
"""

from functools import partial

import jax
import jax.numpy as jnp

from .bcast import bcast
from .gather import allgather, gather
from .reduction import allreduce, reduce

# The ops that work on packed buffers, by name.
TREE_OPS = {op.__name__: op for op in (allreduce, reduce, bcast, allgather, gather)}


@partial(jax.jit, static_argnames=("op_name", "params", "tiled"))
def tree_call(leaves, op_name, params, tiled=False):
    """Apply the op ``op_name`` (a key of ``TREE_OPS``) to each dtype group of ``leaves``.

    The op must map a 1-D buffer to an array whose last axis is that buffer's
    layout (an allreduce keeps the shape; an allgather adds a leading axis).

    Args:
        leaves: tuple of arrays.
        op_name: the op's name, a key of ``TREE_OPS``.
        params: the function's keyword arguments as a tuple of pairs
            (hashable, so that compiled programs are cached across calls).
        tiled: merge the added leading axis into each leaf's first axis.

    Returns:
        The list of result leaves, in the order of ``leaves``.
    """
    call = partial(TREE_OPS[op_name], **dict(params))
    groups = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault(leaf.dtype, []).append(i)
    out = [None] * len(leaves)
    for members in groups.values():
        packed = call(jnp.concatenate([leaves[i].reshape(-1) for i in members]))
        offset = 0
        for i in members:
            shape, n = leaves[i].shape, leaves[i].size
            piece = packed[..., offset : offset + n].reshape(packed.shape[:-1] + shape)
            # The merged length is spelled out: -1 cannot be inferred when a
            # trailing dimension is 0.
            out[i] = piece.reshape((piece.shape[0] * shape[0], *shape[1:])) if tiled else piece
            offset += n
    return out
