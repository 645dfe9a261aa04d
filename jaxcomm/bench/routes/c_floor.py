"""The floor: the same MPI calls from C (``c_floor.c``), built at bench time with the MPI's mpicc."""

from __future__ import annotations

import ctypes
import pathlib

import numpy as np
from mpi4py import MPI

from ..native import build_shared, default_build_dir, load_on_every_rank, mpi_cc
from .base import Impl

FLOOR = "c"  # the column of the C program's times
SOURCE = pathlib.Path(__file__).resolve().parent / "c_floor.c"
_UNKNOWN_OP = -1
_LIBRARY_VERSION_CHARS = (
    8192  # MPI_MAX_LIBRARY_VERSION_STRING is at most this in MPICH and Open MPI
)


def _library_version(lib: ctypes.CDLL) -> str:
    text = ctypes.create_string_buffer(_LIBRARY_VERSION_CHARS)
    length = ctypes.c_int(0)
    lib.jaxcomm_floor_mpi_library(text, ctypes.byref(length))
    return text.value.decode(errors="replace")


def load_floor(
    comm: MPI.Intracomm, build_dir: str | None = None
) -> tuple[ctypes.CDLL | None, str | None]:
    """``c_floor.c`` built with the MPI's mpicc and loaded on every rank.

    Returns:
        ``(library, None)``, or ``(None, why)`` on every rank: no mpicc, a
        failed build, or a library built for another MPI than mpi4py's.
    """
    folder = build_dir or default_build_dir()
    lib, error = load_on_every_rank(comm, lambda: build_shared(SOURCE, mpi_cc(), [], folder))
    if lib is None:
        return None, error
    lib.jaxcomm_floor.restype = ctypes.c_int
    lib.jaxcomm_floor.argtypes = [
        ctypes.c_int64,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
    ]
    # A wrapper of another MPI links another libmpi, which the process would
    # load beside mpi4py's: the calls would go to an MPI that was never started.
    built, running = _first_line(_library_version(lib)), _first_line(MPI.Get_library_version())
    if not comm.allreduce(built == running, op=MPI.LAND):
        return None, f"mpicc's MPI is not mpi4py's ({built!r}, mpi4py runs {running!r})"
    lib.jaxcomm_floor_comm_size.restype = ctypes.c_int
    built_size, mpi4py_size = lib.jaxcomm_floor_comm_size(), MPI._sizeof(MPI.Comm)
    if not comm.allreduce(built_size == mpi4py_size, op=MPI.LAND):
        return None, (
            f"mpicc's MPI ABI is not mpi4py's ({built_size}-byte communicators, mpi4py's are "
            f"{mpi4py_size}: build mpi4py and the floor with the same wrapper, mpicc_abi for "
            "the MPI-5 standard ABI)"
        )
    return lib, None


def _first_line(version: str) -> str:
    # Open MPI's MPI_Get_library_version counts the terminating NUL, which
    # mpi4py then keeps in its string.
    return version.split("\n")[0].replace("\x00", "").strip()


class CFloorImpl(Impl):
    """The floor: each op as the reference's MPI call from a C loop, no Python in between.

    ``jit`` and ``eager`` rows time the call alone; ``loop`` rows the call and
    the step that halves its result into the next input, in C.
    """

    name = FLOOR

    def __init__(self, comm: MPI.Intracomm, lib: ctypes.CDLL):
        self.comm, self.lib = comm, lib

    def runner(self, op, mode, x):
        send = np.array(x, dtype=np.float32, order="C", copy=True)
        recv = np.zeros(op.out_shape(x.shape, self.comm.size), np.float32)
        results = (recv, send, None)
        handle, name, loop = self.comm.py2f(), op.name.encode(), int(mode == "loop")

        def run(n):
            where = self.lib.jaxcomm_floor(
                handle, name, loop, send.ctypes.data, send.size, recv.ctypes.data, recv.size, n
            )
            if where == _UNKNOWN_OP:
                raise ValueError(f"c_floor.c has no op {op.name!r}")
            return results[where]

        return run
