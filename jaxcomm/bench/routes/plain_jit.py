"""The dispatch reference: a jitted function without MPI on the same array."""

from __future__ import annotations

from .base import JaxImpl

PLAIN = "plain"  # jax.jit(lambda x: x + 1): no MPI


def _plus_one(x):
    return x + 1


class PlainJitImpl(JaxImpl):
    """``jax.jit(lambda x: x + 1)``: a jitted call without MPI, the dispatch reference."""

    name = PLAIN
    modes = ("jit", "eager")
    checked = False

    def function(self, op):
        return _plus_one

    def runner(self, op, mode, x):
        # The reference for both modes is a jitted call.
        return super().runner(op, "jit", x)
