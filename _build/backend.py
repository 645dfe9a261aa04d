"""PEP 517 backend: scikit-build-core, plus the mpich wheel when no MPI is found.

The kernels compile against the MPI behind ``mpicc``. When neither
``JAXCOMM_MPICC`` nor a working ``mpicc`` on ``PATH`` names one
(``mpi_wrapper.py``), the build environment gets the ``mpich`` wheel, the same
MPI that ``pip install 'jaxcomm[mpich]'`` installs for run time. And it compiles against the XLA FFI headers of the
jaxlib the wheel will run with (``target_jax.py``). A binary wheel
(``tools/build_wheels.sh``) brings its MPIs (``JAXCOMM_MPI_ABIS``) and FFI
headers (``JAXCOMM_FFI_INCLUDE``) and needs neither.
"""

import os
import sys

from scikit_build_core import build as _backend
from scikit_build_core.build import *  # noqa: F401,F403  (the PEP 517 hooks)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mpi_wrapper import mpicc_on_path_works  # noqa: E402
from target_jax import jaxlib_requirement  # noqa: E402


def _requirements():
    # A binary wheel (tools/build_wheels.sh) names its FFI headers and MPIs itself.
    jaxlib = [] if os.environ.get("JAXCOMM_FFI_INCLUDE") else [jaxlib_requirement()]
    if (
        os.environ.get("JAXCOMM_MPI_ABIS")
        or os.environ.get("JAXCOMM_MPICC")
        or mpicc_on_path_works()
    ):
        return jaxlib
    return [*jaxlib, "mpich"]


def get_requires_for_build_wheel(config_settings=None):
    return [*_backend.get_requires_for_build_wheel(config_settings), *_requirements()]


def get_requires_for_build_editable(config_settings=None):
    return [*_backend.get_requires_for_build_editable(config_settings), *_requirements()]
