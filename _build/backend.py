"""PEP 517 backend: scikit-build-core, plus the mpich wheel when no MPI is found.

The kernels compile against the MPI behind ``mpicc``. When neither
``JAXCOMM_MPICC`` nor ``mpicc`` on ``PATH`` names one, the build environment
gets the ``mpich`` wheel, the same MPI that ``pip install 'jaxcomm[mpich]'``
installs for run time.
"""

import os
import shutil

from scikit_build_core import build as _backend
from scikit_build_core.build import *  # noqa: F401,F403  (the PEP 517 hooks)


def _mpi_requirements():
    if os.environ.get("JAXCOMM_MPICC") or shutil.which("mpicc"):
        return []
    return ["mpich"]


def get_requires_for_build_wheel(config_settings=None):
    return [*_backend.get_requires_for_build_wheel(config_settings), *_mpi_requirements()]


def get_requires_for_build_editable(config_settings=None):
    return [*_backend.get_requires_for_build_editable(config_settings), *_mpi_requirements()]
