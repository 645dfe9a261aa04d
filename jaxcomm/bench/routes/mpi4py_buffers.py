"""The reference route: mpi4py's buffer methods on preallocated NumPy arrays."""

from __future__ import annotations

import functools

import numpy as np
from mpi4py import MPI

from ..operations import loop_step_numpy
from .base import Impl

REFERENCE = "mpi4py"  # every ratio in the table is against this, unless named


class Mpi4pyImpl(Impl):
    """The reference: mpi4py's buffer methods on preallocated NumPy arrays."""

    name = REFERENCE

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm

    def runner(self, op, mode, x):
        send = np.array(x, copy=True)
        recv = np.zeros(op.out_shape(x.shape, self.comm.size), x.dtype)
        call = functools.partial(op.mpi4py, self.comm, send, recv)
        if mode == "loop":

            def run(n):
                for _ in range(n):
                    loop_step_numpy(call(), send)
                return send

        else:

            def run(n):
                out = None
                for _ in range(n):
                    out = call()
                return out

        return run
