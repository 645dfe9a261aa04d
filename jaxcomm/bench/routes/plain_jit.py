"""The dispatch reference: a jitted function without MPI, with the op's output."""

from __future__ import annotations

import jax.numpy as jnp

from .base import JaxImpl

PLAIN = "plain"  # jax.jit(lambda x: x + 1), output shaped as the op's: no MPI


class PlainJitImpl(JaxImpl):
    """A jitted call without MPI that returns an array of the op's output shape.

    ``x + 1`` where the op's output is shaped like its input; otherwise ``x``
    tiled or cut to that shape (``jnp.resize``), plus 1: the same output
    buffer that XLA allocates and writes for the op (``gather``'s and
    ``allgather``'s ``(size, ...)``, ``scatter``'s one block), so that a
    jitted call of the op can be held to mpi4py's time plus this one's.

    Args:
        size: the communicator size the output shapes are for.
    """

    name = PLAIN
    modes = ("jit", "eager")
    checked = False

    def __init__(self, size: int):
        self.size = size

    def function(self, op):
        def plus_one(x):
            shape = op.out_shape(x.shape, self.size)
            return (x if shape == x.shape else jnp.resize(x, shape)) + 1

        return plus_one

    def runner(self, op, mode, x):
        # The reference for both modes is a jitted call.
        return super().runner(op, "jit", x)
