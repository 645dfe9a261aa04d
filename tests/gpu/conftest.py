"""GPU test fixtures: device choice, the skip decision and the data-path switch.

Run on a machine with an NVIDIA GPU and a CUDA-enabled jax:

    XLA_PYTHON_CLIENT_PREALLOCATE=false mpiexec -n 2 python -m pytest --with-mpi tests/gpu

Without a GPU every test here is skipped. ``-m "not large"`` leaves out the
256 MiB transfers. ``tests/gpu/run.sh`` does the whole job (build, 1 and 2
ranks, benchmark) on a fresh machine; see ``tests/gpu/README.md``.

This directory is a package (it has an ``__init__.py``) so that its conftest
does not replace ``tests/conftest.py`` as the module ``conftest``: test
modules here import the suite's helpers with ``from conftest import ...`` and
the GPU ones with ``from .conftest import ...``.
"""

import jax
import pytest
from mpi4py import MPI

import jaxcomm

# Ranks sharing a node take one GPU each (round robin). It must run before
# JAX initialises its backends, so it runs at import; what it raised is kept
# for test_bind_local_gpu, because on a machine without a GPU (the CPU suite
# collects this directory too) failing here would break unrelated tests.
BIND_ERROR = None
BOUND_GPU = None
try:
    BOUND_GPU = jaxcomm.bind_local_gpu()
except RuntimeError as err:  # reported by test_bind_local_gpu
    BIND_ERROR = err


def _local_gpus():
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:  # no GPU backend, or no GPU behind it
        return 0


# The skip decision must be the same on every rank, or collectives deadlock:
# the GPU tests run only when every rank sees a GPU.
GPUS = MPI.COMM_WORLD.allreduce(_local_gpus(), op=MPI.MIN)
NO_GPU_REASON = "JAX sees no GPU (on at least one rank)"
GPU = jax.devices("gpu")[0] if GPUS else None
CPU = jax.devices("cpu")[0]

requires_gpu = pytest.mark.skipif(not GPUS, reason=NO_GPU_REASON)

CUDA_AWARE_REASON = "MPI library is not CUDA-aware"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "large: moves arrays of 256 MiB or more; deselect with -m 'not large'"
    )


def _cuda_info():
    info = jaxcomm.cuda_info()
    if not info["built"]:
        pytest.fail(
            f"JAX sees a GPU, but jaxcomm {jaxcomm.__version__} at {jaxcomm.__file__} "
            "was built without its CUDA kernels"
        )
    return info


@pytest.fixture(scope="session")
def cuda_aware_mpi():
    """Whether every rank's MPI library says it takes GPU pointers."""
    supported = _cuda_info()["mpi_cuda_support"] is True
    return MPI.COMM_WORLD.allreduce(supported, op=MPI.LAND)


@pytest.fixture(params=["host staging", "cuda-aware"])
def data_path(request, cuda_aware_mpi):
    """Run the test with GPU buffers on one data path, then go back to automatic.

    Forcing the CUDA-aware path on an MPI that is not CUDA-aware would crash,
    so it runs only where the MPI library says it is.
    """
    cuda_aware = request.param == "cuda-aware"
    if cuda_aware and not cuda_aware_mpi:
        pytest.skip(CUDA_AWARE_REASON)
    # The kernels read the path at every call, so code compiled under the
    # other path (jit caches survive between tests) takes this one too.
    jaxcomm.set_cuda_aware(cuda_aware)
    assert jaxcomm.cuda_info()["cuda_aware"] is cuda_aware
    yield request.param
    jaxcomm.set_cuda_aware(None)


def on_gpu(value):
    """``value`` as a JAX array on this rank's GPU."""
    return jax.device_put(value, GPU)


def assert_on(result, device=None):
    """Assert that every array in ``result`` lives on ``device`` (default: the GPU)."""
    device = GPU if device is None else device
    for leaf in jax.tree_util.tree_leaves(result):
        assert leaf.devices() == {device}, f"result on {leaf.devices()}, expected {device}"
