"""jaxcomm's route: the methods of a :class:`~jaxcomm.JaxComm`."""

from __future__ import annotations

import functools

import jax

from ... import sync
from ...comm import JaxComm
from .base import JaxImpl


class JaxcommImpl(JaxImpl):
    """jaxcomm's methods on a :class:`JaxComm`."""

    name = "jaxcomm"

    def __init__(self, jc: JaxComm):
        self.jc = jc

    def function(self, op):
        return functools.partial(op.jaxcomm, self.jc)

    def wait(self, out, op, mode):
        jax.block_until_ready(out)
        # A compiled barrier has no output to wait on; eagerly it has returned
        # once complete.
        if not op.sized and mode != "eager":
            sync()
